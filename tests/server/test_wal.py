"""The store server's write-ahead log and snapshots: round trips, crashes, corruption, the dir lock."""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from rdzv.errors import RendezvousStateError, StoreError, StoreValueError
from rdzv.server._wal import WriteAheadLog
from rdzv.server._wal_format import SessionRequest
from rdzv.kv import Delete, KVState, Put, SessionClose, SessionOpen

LOG_0 = "wal-0000000000000000.log"


# -- helpers ---------------------------------------------------------------------------------------
def assert_same_state(recovered: KVState, expected: KVState) -> None:
    assert sorted(recovered.items()) == sorted(expected.items())
    assert recovered.revision == expected.revision
    assert recovered.session_ttls == expected.session_ttls
    assert recovered.session_tokens == expected.session_tokens
    assert recovered.last_session == expected.last_session
    assert recovered.path_revisions() == expected.path_revisions()


def live_state() -> KVState:
    state = KVState()
    state.effects = []
    return state


def commit(wal: WriteAheadLog, state: KVState) -> None:
    """What the server does per batch: log the batch's effects, flush, then acknowledge."""
    assert state.effects is not None
    wal.append(state.effects)
    state.effects.clear()
    wal.flush()


def recover(data_dir: Path) -> KVState:
    """What a restarted server finds in ``data_dir``."""
    with WriteAheadLog(data_dir) as wal:
        return wal.recover()


def replayed(effects: list) -> KVState:
    state = KVState()
    for effect in effects:
        state.apply(effect)
    return state


def busy_state(state: KVState) -> None:
    """Writes of every kind: plain, ephemeral, counters, deletes, sessions opened and closed."""
    state.set("job/round", b"1")
    alive = state.open_session(15.0, b"token of alive!!")
    dead = state.open_session(2.5)
    state.set("job/nodes/a", b"\x00\xffbinary", alive)
    state.set("job/nodes/b", b"", dead)
    state.multi_set(["job/x", "job/y"], [b"x", b"y" * 1000])
    state.add("job/counter", 5)
    state.append("job/log", b"line1\n")
    state.append("job/log", b"line2\n")
    state.compare_set("job/round", b"1", b"2")
    state.set("ключ/ü\udcff", "значение".encode())
    state.delete("job/x")
    state.close_session(dead)


@pytest.fixture
def spawn():
    """Start Python child processes; every one still running is killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(code: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            pipe.close()


def read_line(proc: subprocess.Popen, timeout: float) -> bytes:
    """The next line the child prints, or b"" at its end or after ``timeout`` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else b""


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("fsync", ["always", "never"])
def test_every_effect_round_trips(tmp_path: Path, fsync: str) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path, fsync=fsync) as wal:
        assert_same_state(wal.recover(), KVState())
        busy_state(state)
        kinds = {type(e) for e in state.effects}
        assert kinds == {Put, Delete, SessionOpen, SessionClose}
        commit(wal, state)
    assert_same_state(recover(tmp_path), state)


def test_recovered_log_keeps_growing(tmp_path: Path) -> None:
    state = live_state()
    for round_ in range(3):
        with WriteAheadLog(tmp_path) as wal:
            assert_same_state(wal.recover(), state)
            state.set(f"round/{round_}", b"%d" % round_)
            state.delete(f"round/{round_ - 1}")
            commit(wal, state)
    assert_same_state(recover(tmp_path), state)
    assert sorted(k for k, _, _ in state.items()) == ["round/2"]


def test_unflushed_records_are_written_by_close(tmp_path: Path) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        state.set("k", b"v")
        wal.append(state.effects)
    assert recover(tmp_path).get("k") == b"v"


# -- crashes mid-write (torn tails) -----------------------------------------------------------
def test_torn_last_record_is_cut_off_at_every_byte(tmp_path: Path, caplog) -> None:
    state = live_state()
    busy_state(state)
    effects = list(state.effects)
    source = tmp_path / "source"
    ends = []  # the log's size after each record
    with WriteAheadLog(source, fsync="never") as wal:
        wal.recover()
        for effect in effects:
            wal.append([effect])
            wal.flush()
            ends.append((source / LOG_0).stat().st_size)
    data = (source / LOG_0).read_bytes()
    # the last records of several kinds: a big Put, a Delete, a SessionClose (the very last)
    checked = {type(effects[i]) for i in range(len(effects) - 6, len(effects))}
    assert {Put, Delete, SessionClose} <= checked
    crashed = tmp_path / "crashed"
    for index in range(len(effects) - 6, len(effects)):
        start, end = ends[index - 1], ends[index]
        for cut in range(start + 1, end):
            shutil.rmtree(crashed, ignore_errors=True)
            crashed.mkdir()
            (crashed / LOG_0).write_bytes(data[:cut])
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rdzv.server._wal"):
                assert_same_state(recover(crashed), replayed(effects[:index]))
            assert "cut short by a crash" in caplog.text
            assert (crashed / LOG_0).stat().st_size == start


def test_writes_after_a_torn_tail_are_recovered(tmp_path: Path) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        state.set("a", b"1")
        commit(wal, state)
        size = (tmp_path / LOG_0).stat().st_size
        state.set("b", b"2")
        commit(wal, state)
    os.truncate(tmp_path / LOG_0, size + 5)
    with WriteAheadLog(tmp_path) as wal:
        recovered = wal.recover()
        assert recovered.get("b") is None
        recovered.effects = []
        recovered.set("c", b"3")
        commit(wal, recovered)
    final = recover(tmp_path)
    assert (final.get("a"), final.get("b"), final.get("c")) == (b"1", None, b"3")


def test_zero_filled_tail_counts_as_torn(tmp_path: Path) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        state.set("a", b"1")
        commit(wal, state)
    with open(tmp_path / LOG_0, "ab") as file:
        file.write(bytes(100))
    assert_same_state(recover(tmp_path), state)


# -- corruption ------------------------------------------------------------------------------------
def write_three_records(data_dir: Path) -> list[int]:
    """A log with keys a, b, c; the offsets at which each record starts (and the end)."""
    state = live_state()
    offsets = []
    with WriteAheadLog(data_dir) as wal:
        wal.recover()
        for key in "abc":
            offsets.append((data_dir / LOG_0).stat().st_size)
            state.set(key, key.encode() * 20)
            commit(wal, state)
    return offsets + [(data_dir / LOG_0).stat().st_size]


@pytest.mark.parametrize("where", ["length", "checksum", "payload"])
def test_corruption_in_the_middle_is_an_error(tmp_path: Path, where: str) -> None:
    offsets = write_three_records(tmp_path)
    position = offsets[1] + {"length": 1, "checksum": 5, "payload": 30}[where]
    path = tmp_path / LOG_0
    data = bytearray(path.read_bytes())
    data[position] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(RendezvousStateError) as info:
        recover(tmp_path)
    message = str(info.value)
    assert str(path) in message and f"offset {offsets[1]}" in message
    assert f"truncate -s {offsets[1]}" in message and "backup" in message
    assert path.read_bytes() == bytes(data), "a corrupt log must be left as it is"


def test_corrupt_last_record_followed_by_garbage_is_an_error(tmp_path: Path) -> None:
    offsets = write_three_records(tmp_path)
    path = tmp_path / LOG_0
    data = bytearray(path.read_bytes())
    data[offsets[2] + 30] ^= 0x01
    path.write_bytes(bytes(data) + b"not a record, not zeros")
    with pytest.raises(RendezvousStateError, match=f"offset {offsets[2]}"):
        recover(tmp_path)


def test_foreign_and_newer_files_are_refused(tmp_path: Path) -> None:
    write_three_records(tmp_path)
    path = tmp_path / LOG_0
    original = path.read_bytes()
    path.write_bytes(b"SQLite format 3\x00" + original[16:])
    with pytest.raises(RendezvousStateError, match="not an rdzv log file"):
        recover(tmp_path)
    fields = struct.pack("<8sIQ", b"RDZVWAL\x00", 99, 0)
    path.write_bytes(fields + zlib.crc32(fields).to_bytes(4, "little") + original[24:])
    with pytest.raises(RendezvousStateError, match="newer rdzv.*format 99.*upgrade"):
        recover(tmp_path)


# -- snapshots --------------------------------------------------------------------------------
def test_snapshots_then_log_replay(tmp_path: Path) -> None:
    state = live_state()
    session = state.open_session(5.0)
    with WriteAheadLog(tmp_path, snapshot_bytes=2000) as wal:
        wal.recover()
        for i in range(300):
            state.set(f"nodes/{i % 40}", b"x" * (i % 50), session if i % 3 else 0)
            if i % 7 == 0:
                state.delete(f"nodes/{(i + 5) % 40}")
            commit(wal, state)
            wal.snapshot_if_due(state)
        generation_files = sorted(p.name for p in tmp_path.iterdir() if p.name != "LOCK")
    assert len(generation_files) == 2, generation_files  # older generations were removed
    snapshot, log = generation_files
    assert snapshot.startswith("snapshot-") and log.startswith("wal-")
    assert snapshot[len("snapshot-"):-len(".snap")] == log[len("wal-"):-len(".log")] != "0" * 16
    assert (tmp_path / log).stat().st_size > 24, "the test must also replay records after the snapshot"
    assert_same_state(recover(tmp_path), state)


def test_last_write_of_each_session_survives_log_and_snapshot(tmp_path: Path) -> None:
    """What lets a restarted server answer a resent write without applying it twice."""
    state = live_state()
    first, second, closed = (state.open_session(30.0) for _ in range(3))
    state.add("n", 5)
    state.effects += [SessionRequest(first, 7, b"answer"), SessionRequest(second, 3, None)]
    state.effects.append(SessionRequest(closed, 2, b"gone"))
    state.close_session(closed)
    expected = {first: SessionRequest(first, 7, b"answer"), second: SessionRequest(second, 3, None)}
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        commit(wal, state)
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        assert wal.requests == expected  # from the log
        wal.snapshot(state, {**expected, closed: SessionRequest(closed, 2, b"")})
    with WriteAheadLog(tmp_path) as wal:
        assert_same_state(wal.recover(), state)
        assert wal.requests == expected  # from the snapshot (a closed session's is not kept)


def test_snapshot_of_an_empty_state_and_of_closed_sessions(tmp_path: Path) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        wal.snapshot(state)
        for _ in range(3):
            state.close_session(state.open_session(1.0))
        state.set("k", b"v")
        state.delete("k")
        commit(wal, state)
        wal.snapshot(state)
    recovered = recover(tmp_path)
    assert_same_state(recovered, state)
    assert recovered.num_keys() == 0 and recovered.revision == 2 and recovered.last_session == 3


def test_failed_snapshot_loses_nothing(tmp_path: Path, caplog) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path, snapshot_bytes=100) as wal:
        wal.recover()
        state.set("before", b"1" * 200)
        commit(wal, state)
        blocker = tmp_path / "snapshot-0000000000000001.tmp"
        blocker.mkdir()  # the snapshot's temp file cannot be created
        with caplog.at_level(logging.ERROR, logger="rdzv.server._wal"):
            wal.snapshot_if_due(state)
        assert "snapshot failed" in caplog.text
        state.set("after", b"2")
        commit(wal, state)
    blocker.rmdir()
    assert_same_state(recover(tmp_path), state)


def test_leftovers_of_an_interrupted_snapshot_are_cleaned_up(tmp_path: Path) -> None:
    state = live_state()
    old = tmp_path / "old"
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        busy_state(state)
        commit(wal, state)
        shutil.copytree(tmp_path, old, ignore=shutil.ignore_patterns("LOCK", "old"))
        wal.snapshot(state)
        state.set("after", b"snapshot")
        commit(wal, state)
    # as if the server died before removing the older generation, while writing the next snapshot
    shutil.copy(old / LOG_0, tmp_path / LOG_0)
    (tmp_path / "snapshot-0000000000000002.tmp").write_bytes(b"half a snapshot")
    shutil.rmtree(old)
    assert_same_state(recover(tmp_path), state)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "LOCK", "snapshot-0000000000000001.snap", "wal-0000000000000001.log"
    ]


def test_corrupt_snapshot_is_an_error_naming_it(tmp_path: Path) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        busy_state(state)
        commit(wal, state)
        wal.snapshot(state)
    path = tmp_path / "snapshot-0000000000000001.snap"
    data = bytearray(path.read_bytes())
    data[60] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(RendezvousStateError, match=r"snapshot-0000000000000001\.snap is corrupt"):
        recover(tmp_path)
    path.write_bytes(bytes(data[:-3]))  # a snapshot cut short is never taken as complete
    with pytest.raises(RendezvousStateError, match="snapshot-0000000000000001.snap"):
        recover(tmp_path)


def test_missing_log_in_the_chain_is_an_error(tmp_path: Path) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        state.set("k", b"v")
        commit(wal, state)
        wal.snapshot(state)
    (tmp_path / "snapshot-0000000000000001.snap").unlink()
    with pytest.raises(RendezvousStateError, match=r"wal-0000000000000000\.log is missing"):
        recover(tmp_path)


# -- ids and revisions across recovery -----------------------------------------------------------
@pytest.mark.parametrize("with_snapshot", [False, True])
def test_session_ids_are_never_reused(tmp_path: Path, with_snapshot: bool) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        sessions = [state.open_session(3.0) for _ in range(5)]
        state.set("eph", b"1", sessions[1])
        for session in sessions[2:]:
            state.close_session(session)  # the highest ids are no longer in the session table
        commit(wal, state)
        if with_snapshot:
            wal.snapshot(state)
    recovered = recover(tmp_path)
    assert set(recovered.session_ttls) == {sessions[0], sessions[1]}
    assert recovered.session_keys(sessions[1]) == 1
    assert recovered.open_session(1.0) == max(sessions) + 1


@pytest.mark.parametrize("with_snapshot", [False, True])
def test_revisions_never_go_backwards(tmp_path: Path, with_snapshot: bool) -> None:
    state = live_state()
    with WriteAheadLog(tmp_path) as wal:
        wal.recover()
        state.set("dir/a", b"1")
        state.set("dir/b", b"2")
        seen = state.path_revision("dir/")
        state.delete("dir/a")
        state.delete("dir/b")  # the last changes leave no key behind
        commit(wal, state)
        if with_snapshot:
            wal.snapshot(state)
    recovered = recover(tmp_path)
    assert recovered.revision == state.revision == 4
    assert recovered.path_revision("dir/") == recovered.path_revision("dir/b") == 4 > seen
    recovered.set("dir/c", b"3")
    assert recovered.revision == 5


# -- the data dir lock and real crashes ------------------------------------------------------------
LOCK_HOLDER = """
import sys
from rdzv.server._wal import WriteAheadLog
wal = WriteAheadLog(sys.argv[1])
print("locked", flush=True)
sys.stdin.readline()
wal.close()
"""


def test_second_process_cannot_share_the_data_dir(tmp_path: Path, spawn) -> None:
    holder = spawn(LOCK_HOLDER, str(tmp_path))
    assert read_line(holder, 60) == b"locked\n", holder.stderr.read().decode()
    with pytest.raises(StoreError) as info:
        WriteAheadLog(tmp_path)
    assert str(tmp_path) in str(info.value) and f"pid {holder.pid}" in str(info.value)
    holder.send_signal(signal.SIGKILL)  # a dead holder's lock goes away with it
    holder.wait(timeout=30)
    recover(tmp_path)


def test_lock_is_released_by_close(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    with pytest.raises(StoreError, match="in use"):
        WriteAheadLog(tmp_path)
    wal.close()
    wal.close()
    WriteAheadLog(tmp_path).close()


WRITER = """
import sys
from rdzv.server._wal import WriteAheadLog
wal = WriteAheadLog(sys.argv[1], fsync=sys.argv[2], snapshot_bytes=3000)
state = wal.recover()
state.effects = []
session = state.open_session(10.0)
start = state.num_keys()
for i in range(start, start + 200_000):
    state.set(f"key/{i}", b"value-%d" % i, session if i % 2 else 0)
    wal.append(state.effects)
    state.effects.clear()
    wal.flush()
    print(i, flush=True)
    wal.snapshot_if_due(state)
"""


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_sigkilled_writer_keeps_every_acknowledged_write(tmp_path: Path, spawn, fsync: str) -> None:
    """A writer is killed mid-stream, restarted on the recovered data, killed again (3 times)."""
    acknowledged: list[int] = []
    for run in range(1, 4):
        writer = spawn(WRITER, str(tmp_path), fsync)
        target = len(acknowledged) + 300 * run
        deadline = time.monotonic() + 60
        while len(acknowledged) < target and time.monotonic() < deadline:
            line = read_line(writer, deadline - time.monotonic())
            if not line:
                break
            acknowledged.append(int(line))
        assert len(acknowledged) >= target, writer.stderr.read().decode()
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        rest = writer.stdout.read().split(b"\n")
        acknowledged += [int(line) for line in rest[:-1]]  # the last piece may be cut mid-line
        state = recover(tmp_path)
        keys = {key for key, _, _ in state.items()}
        for i in acknowledged:
            assert state.get(f"key/{i}") == b"value-%d" % i
        assert keys == {f"key/{i}" for i in range(len(keys))}, "recovered writes have no gaps"
        assert state.revision == len(keys) and state.last_session == run
        assert set(state.session_ttls) == set(range(1, run + 1))


FULL_DISK_WRITER = """
import resource, signal, sys
from rdzv.errors import StoreError
from rdzv.server._wal import WriteAheadLog
wal = WriteAheadLog(sys.argv[1], fsync="never")
state = wal.recover()
state.effects = []
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, hard))  # writes past 5000 bytes fail
for i in range(10_000):
    state.set(f"key/{i}", b"v" * 77)
    wal.append(state.effects)
    state.effects.clear()
    try:
        wal.flush()
    except StoreError as exc:
        print("error:", exc, flush=True)
        break
    print(i, flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
state.set("later", b"x")
wal.append(state.effects)
try:
    wal.flush()
except StoreError as exc:
    print("refused:", exc, flush=True)
wal.close()
"""


def test_failed_write_is_cut_off_and_stops_the_log(tmp_path: Path, spawn, caplog) -> None:
    writer = spawn(FULL_DISK_WRITER, str(tmp_path))
    out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    acknowledged = [int(line) for line in lines if line.isdigit()]
    errors = [line for line in lines if not line.isdigit()]
    assert len(acknowledged) > 10 and len(errors) == 2, lines
    assert errors[0].startswith("error: cannot write the write-ahead log") and "File too large" in errors[0]
    assert errors[1] == "refused: " + errors[0][len("error: "):], "nothing is logged after a failure"
    with caplog.at_level(logging.WARNING, logger="rdzv.server._wal"):
        state = recover(tmp_path)
    assert caplog.text == "", "the failed write was cut off cleanly"
    assert sorted(k for k, _, _ in state.items()) == sorted(f"key/{i}" for i in acknowledged)


# -- misuse ------------------------------------------------------------------------------------------
def test_bad_arguments_and_misuse_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreValueError, match="fsync must be one of"):
        WriteAheadLog(tmp_path, fsync="sometimes")
    with pytest.raises(StoreValueError, match="snapshot_bytes"):
        WriteAheadLog(tmp_path, snapshot_bytes=0)
    with WriteAheadLog(tmp_path) as wal:
        wal.append([Put(1, "k", b"v", 0)])
        with pytest.raises(StoreError, match="recover"):
            wal.flush()
        wal.recover()
        with pytest.raises(StoreError, match="once"):
            wal.recover()
        with pytest.raises(TypeError, match="cannot log"):
            wal.append([("k", b"v")])  # type: ignore[list-item]
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot use data dir"):
        WriteAheadLog(tmp_path / "file")


def test_a_data_dir_written_before_the_shared_effect_encoding_loads(tmp_path: Path) -> None:
    """A data dir of log format 3, written by the rdzv release before effects got one encoding
    shared with the FileStore (``data/datadir-format-3``: 5 keys set, a counter added to 7, one
    key deleted, a non-ASCII key), is served as it was written."""
    from rdzv.server import StoreServer
    from rdzv.store import TCPStore

    data_dir = tmp_path / "data"
    shutil.copytree(Path(__file__).parent / "data" / "datadir-format-3", data_dir)
    server = StoreServer(host="127.0.0.1", port=0, data_dir=data_dir)
    server.start()
    try:
        with TCPStore("127.0.0.1", server.port, timeout=10) as client:
            assert client.list_keys("run/") == {
                "run/k1": b"v1", "run/k2": b"v2", "run/k3": b"v3", "run/k4": b"v4",
                "run/n": b"7", "run/ü": b"x"}
            assert client.add("run/n", 1) == 8
    finally:
        server.stop()
    assert recover(data_dir).items()  # and what it logged since reads back
