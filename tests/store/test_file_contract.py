"""FileStore passes the Store contract, with peers in real child processes sharing one file."""

from __future__ import annotations

import gc
import os
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from store_contract import StoreContract, eventually

from rdzv.errors import RendezvousStateError, StoreConnectionError, StoreUnsupportedError
from rdzv.store import FileStore, Store

SESSION_TTL = 2.0


class CountingFileStore(FileStore):
    """A FileStore that adds a byte to the file ``looks`` each time a waiting call looks at the
    store in vain: the test's sign that a call (of any process) is blocked in the store."""

    def __init__(self, file_name: str | Path, *, looks: str, **options: Any) -> None:
        self.looks = looks
        super().__init__(file_name, **options)

    def _poll(self, ready: Callable[[Any], Any], timeout: float) -> Any:
        def look(state: Any) -> Any:
            found = ready(state)
            if found is None:
                with open(self.looks, "ab") as looks:
                    looks.write(b".")
            return found

        return super()._poll(look, timeout)


class FileStoreFactory:
    """Clients of one fresh store file in a test's temporary directory (FileStores that count
    the looks of their waiting calls, see :meth:`blocked`)."""

    session_ttl = SESSION_TTL

    def __init__(self, path: Path, **options: Any) -> None:
        self.path = path
        self.looks = str(path) + ".looks"
        self.options = {"session_ttl": SESSION_TTL, **options}
        self.clients: list[FileStore] = []

    def new_client(self) -> Store:
        client = CountingFileStore(self.path, looks=self.looks, timeout=30, **self.options)
        self.clients.append(client)
        return client

    def child_spec(self) -> dict[str, Any]:
        return {"factory": "test_file_contract:CountingFileStore",
                "kwargs": {"file_name": str(self.path), "looks": self.looks, **self.options}}

    def blocked(self) -> int:
        """The looks in vain of waiting calls so far, in every process."""
        try:
            return os.path.getsize(self.looks)
        except FileNotFoundError:
            return 0

    def bad_constructions(self) -> list[tuple[Callable[[], Any], type, str]]:
        path = self.path
        return [
            (lambda: FileStore(""), ValueError, "FileStore needs a file name"),
            (lambda: FileStore(None), TypeError, "NoneType"),  # type: ignore[arg-type]
            (lambda: FileStore(path, 0), ValueError, "world_size must be a positive int or -1"),
            (lambda: FileStore(path, -2), ValueError, "world_size must be a positive int or -1"),
            (lambda: FileStore(path, timeout=-1), ValueError, "timeout must be >= 0"),
            (lambda: FileStore(path, session_ttl=0), ValueError, "session_ttl must be > 0"),
            (lambda: FileStore(path, compact_bytes=0), ValueError, "compact_bytes must be a positive int"),
        ]

    def close(self) -> None:
        for client in self.clients:
            client.close()


class TestFileStore(StoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[FileStoreFactory]:
        factory = FileStoreFactory(tmp_path / "store")
        yield factory
        factory.close()


class TestFileStoreCompacting(StoreContract):
    """The same contract while the log is compacted every few KiB."""

    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[FileStoreFactory]:
        factory = FileStoreFactory(tmp_path / "store", compact_bytes=2048)
        yield factory
        factory.close()


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[FileStoreFactory]:
    made = FileStoreFactory(tmp_path / "store")
    yield made
    made.close()


def test_foreign_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not-a-store"
    path.write_bytes(b"\x05\x00\x00\x00hello, torch FileStore data")
    with pytest.raises(RendezvousStateError, match="not an rdzv FileStore file") as info:
        FileStore(path, session_ttl=SESSION_TTL)
    assert str(path) in str(info.value)
    assert path.read_bytes().startswith(b"\x05\x00\x00\x00hello")


def test_corrupt_record_names_file_and_offset(factory: FileStoreFactory) -> None:
    store = factory.new_client()
    store.set("first", "1")
    offset = factory.path.stat().st_size
    store.set("second", "2")
    data = bytearray(factory.path.read_bytes())
    data[-1] ^= 0xFF
    factory.path.write_bytes(bytes(data))
    with pytest.raises(RendezvousStateError, match=f"offset {offset}") as info:
        FileStore(factory.path, session_ttl=SESSION_TTL)
    assert str(factory.path) in str(info.value)


def test_torn_last_record_is_dropped(factory: FileStoreFactory, caplog: Any) -> None:
    store = factory.new_client()
    store.set("kept", "1")
    before = factory.path.stat().st_size
    store.set("torn", "2")
    whole = factory.path.stat().st_size
    store.close()
    with open(factory.path, "r+b") as file:  # as if the writer died mid-write
        file.truncate(before + (whole - before) // 2)
    reader = factory.new_client()
    assert reader.try_get("kept") == b"1"
    assert reader.try_get("torn") is None
    assert "incomplete last record" in caplog.text
    reader.set("after", "3")
    assert factory.new_client().multi_get(["kept", "after"]) == [b"1", b"3"]


def test_compaction_keeps_data_revisions_and_sessions(tmp_path: Path) -> None:
    factory = FileStoreFactory(tmp_path / "store", compact_bytes=1024)
    try:
        writer, early = factory.new_client(), factory.new_client()
        writer.set("mine", "e", ephemeral=True)
        writer.set("dir/gone", "x")
        writer.delete_key("dir/gone")
        seen = early.revision("dir/")
        for round_ in range(300):
            writer.set(f"key{round_ % 10}", str(round_))
        assert factory.path.stat().st_size < 8 * 1024
        assert not [p for p in tmp_path.iterdir() if ".compact-" in p.name]
        late = factory.new_client()
        for reader in (early, late):
            assert reader.multi_get([f"key{n}" for n in range(10)]) == [
                str(290 + n).encode() for n in range(10)
            ]
            assert reader.revision("") >= writer.revision("key9")
            assert reader.try_get("mine") == b"e"
        assert early.watch("dir/", seen, 0.1) <= seen
        assert late.revision("key0") >= writer.revision("key0")
        writer.close()
        assert late.try_get("mine") is None and early.try_get("mine") is None
    finally:
        factory.close()


def test_world_size_deletes_file_after_last_close(tmp_path: Path) -> None:
    path = tmp_path / "job"
    first = FileStore(path, 2, session_ttl=SESSION_TTL)
    second = FileStore(path, 2, session_ttl=SESSION_TTL)
    first.set("k", "v")
    first.close()
    assert path.exists() and second.get("k") == b"v"
    second.close()
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []
    with FileStore(path, session_ttl=SESSION_TTL) as unbounded:
        unbounded.set("k", "v")
    assert path.exists()


def test_stopped_then_resumed_client_learns_its_session_expired(
    factory: FileStoreFactory,
) -> None:
    from _peers import PeerError, ProcessPeer

    store = factory.new_client()
    peer = ProcessPeer(factory.child_spec())
    try:
        peer.call("set", "eph", "1", ephemeral=True)
        peer.stop()
        eventually(lambda: store.try_get("eph") is None, 3 * SESSION_TTL + 45, "expiry")
        peer.resume()
        with pytest.raises(PeerError, match="expired") as info:
            peer.call("set", "eph", "2", ephemeral=True)
        assert info.value.type_name == "SessionExpiredError"
        peer.call("set", "durable", "3")
        assert store.get("durable") == b"3"
    finally:
        peer.close()


@pytest.mark.parametrize(
    "options, error",
    [({"world_size": 0}, ValueError), ({"session_ttl": 0}, ValueError), ({"timeout": -1}, ValueError)],
)
def test_bad_options(tmp_path: Path, options: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        FileStore(tmp_path / "store", **options)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "no-such-dir" / "store"
    with pytest.raises(StoreConnectionError, match="no-such-dir"):
        FileStore(path)


def test_writer_killed_mid_stream_leaves_a_consistent_store(factory: FileStoreFactory) -> None:
    from _peers import ProcessPeer

    store = factory.new_client()
    peer = ProcessPeer(factory.child_spec())
    try:
        peer.call("set", "ready", "1")
        peer.request("add_many", "counter", 1, 100_000)
        eventually(lambda: int(store.try_get("counter") or 0) > 100, 60, "the child is adding")
        peer.kill()
        counted = int(store.get("counter"))
        assert store.add("counter", 1) == counted + 1
        assert factory.new_client().get("counter") == str(counted + 1).encode()
    finally:
        peer.close()


def _heartbeats() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("FileStore heartbeat")}


@pytest.mark.parametrize("world_size", [2, -1])
def test_dropping_the_last_reference_releases_the_store(tmp_path: Path, world_size: int) -> None:
    """torch-style code never calls close(): dropping a FileStore ends its session (its
    ephemeral keys go) and its heartbeat thread; once every one of ``world_size`` clients is
    gone the file is deleted, as torch's FileStore does (world_size -1: the file stays)."""
    path = tmp_path / "store"
    before = _heartbeats()
    first, second = FileStore(path, world_size), FileStore(path, world_size)
    first.set("mine", "1", ephemeral=True)
    first.set("kept", "1")
    started = _heartbeats() - before
    assert len(started) == 2
    del first
    gc.collect()
    assert second.try_get("mine") is None and second.get("kept") == b"1"
    eventually(lambda: len(_heartbeats() & started) == 1, 10, "the dropped store's heartbeat ends")
    assert path.exists()
    del second
    gc.collect()
    eventually(lambda: not _heartbeats() & started, 10, "every heartbeat ends")
    assert path.exists() == (world_size == -1)


FORMAT_1 = Path(__file__).parent / "data" / "filestore-format-1.store"
"""A file written by the rdzv release before effects got one encoding shared with the server's
log: 12 keys set then one deleted, a counter at 42, a key appended to twice, an ephemeral key
whose client closed, a non-ASCII key; compacted once (a snapshot record, then log records)."""


def file_version(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[8:12], "little")


def test_a_file_of_format_1_loads_and_is_rewritten_in_format_2_by_its_first_client(
        tmp_path: Path) -> None:
    """A client opens its session (a write) at once: the file is rewritten then, and an rdzv of
    format 1 still attached stops with an error naming the version (the test below)."""
    path = tmp_path / "job.store"
    shutil.copy(FORMAT_1, path)
    expected = {f"job/key{i}": f"value {i}".encode() for i in range(12) if i != 3}
    expected.update({"job/counter": b"42", "job/log": b"ab", "job/ü": b"unicode"})
    with FileStore(path) as first, FileStore(path) as second:
        assert file_version(path) == 2
        assert first.list_keys("job/") == expected and first.revision("") == 20
        first.set("job/new", "after the rewrite")
        assert second.list_keys("job/") == {**expected, "job/new": b"after the rewrite"}
        assert second.revision("") == 21
    with FileStore(path) as fresh:
        assert fresh.list_keys("job/") == {**expected, "job/new": b"after the rewrite"}


def test_a_file_of_a_newer_format_is_refused_with_the_versions_named(tmp_path: Path) -> None:
    data = bytearray(FORMAT_1.read_bytes())
    data[8:12] = (3).to_bytes(4, "little")
    data[36:40] = zlib.crc32(bytes(data[:36])).to_bytes(4, "little")
    path = tmp_path / "job.store"
    path.write_bytes(bytes(data))
    with pytest.raises(RendezvousStateError, match="format version 3; this rdzv reads versions "
                       "1 to 2: use the same rdzv version on every host"):
        FileStore(path).get("job/key0")


def test_a_read_only_client_leaves_a_file_of_format_1_as_it_is(tmp_path: Path) -> None:
    """``rdzv status`` on a job still run by an rdzv of format 1 reads it without rewriting
    the file (which would stop that job's clients): a read-only client opens no session."""
    path = tmp_path / "job.store"
    shutil.copy(FORMAT_1, path)
    before = path.read_bytes()
    with FileStore(path, read_only=True) as observer:
        assert observer.get("job/counter") == b"42" and observer.num_keys() == 14
        with pytest.raises(StoreUnsupportedError, match="opened read_only: it writes nothing"):
            observer.set("job/new", "x")
    assert path.read_bytes() == before
