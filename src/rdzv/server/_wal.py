"""Durability of the store server: a write-ahead log of state effects, and snapshots.

The data dir holds ``LOCK`` (an exclusive ``flock`` so that one server at a time owns the dir),
``snapshot-<gen>.snap`` (the full state when generation ``gen`` began; none for generation 0)
and ``wal-<gen>.log`` (every effect after that snapshot). Recovery reads the newest snapshot and
replays the logs from its generation on; a torn last record (a crash mid-write) is cut off
with a warning, any other damage raises :class:`RendezvousStateError` naming file and offset.

Both kinds of file start with a header (magic, format version, generation, CRC32) followed by
records: ``<u32 length><u32 crc32(payload)><u32 crc32(those 8 bytes)>`` then the payload, whose
first byte is the record type. The header checksum tells a corrupted length (an error) from a
record cut short at the end of the file (a torn write). See ``docs/durability.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import struct
import zlib
from pathlib import Path
from typing import NamedTuple, Union

from ..errors import RendezvousStateError, StoreError, StoreValueError
from ..store._state import Delete, Effect, KVState, Put, SessionClose, SessionOpen

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""The version of the file format written; files of a newer version are refused."""

DEFAULT_SNAPSHOT_BYTES = 16 * 1024 * 1024
"""Log bytes after which a snapshot is written (or more: at least the last snapshot's size)."""

FSYNC_MODES = ("always", "never")

_LOG_MAGIC = b"RDZVWAL\x00"
_SNAPSHOT_MAGIC = b"RDZVSNP\x00"
_FILE_NAME = re.compile(r"^(wal|snapshot)-(\d{16})\.(log|snap)$")
_TEMP_NAME = re.compile(r"^(wal|snapshot)-\d{16}\.tmp$")
_SUFFIX = {"wal": "log", "snapshot": "snap"}

_FILE_HEADER = struct.Struct("<8sIQI")  # magic, format version, generation, crc32 of the rest
_LENGTH_CRC = struct.Struct("<II")  # payload length, crc32(payload)
_RECORD_HEADER = struct.Struct("<III")  # the above, then crc32 of those 8 bytes

_PUT, _DELETE, _SESSION_OPEN, _SESSION_CLOSE, _PATH_REVISION, _SNAPSHOT_META = range(1, 7)
_PUT_HEAD = struct.Struct("<BQQI")  # type, revision, session, key length; then key, value
_DELETE_HEAD = struct.Struct("<BQ")  # type, revision; then key
_SESSION_OPEN_BODY = struct.Struct("<BQd")  # type, session, ttl
_SESSION_CLOSE_BODY = struct.Struct("<BQ")  # type, session
_PATH_REVISION_HEAD = struct.Struct("<BQ")  # type, revision; then path
_SNAPSHOT_META_BODY = struct.Struct("<BQQQQQ")  # type, revision, last session, counts x3


class _PathRevision(NamedTuple):
    """Snapshot record: ``path`` last changed at ``revision``."""

    path: str
    revision: int


class _SnapshotMeta(NamedTuple):
    """Snapshot record (the first): the counters and how many records of each kind follow."""

    revision: int
    last_session: int
    keys: int
    sessions: int
    paths: int


_Record = Union[Put, Delete, SessionOpen, SessionClose, _PathRevision, _SnapshotMeta]


# -- encoding ------------------------------------------------------------------------------------
def _frame(payload: bytes) -> bytes:
    """One record: its checksummed header, then ``payload``."""
    head = _LENGTH_CRC.pack(len(payload), zlib.crc32(payload))
    return head + zlib.crc32(head).to_bytes(4, "little") + payload


def _text(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _encode(record: _Record) -> bytes:
    """The framed record of an effect (or of a snapshot-only record)."""
    kind = type(record)
    if kind is Put:
        key = _text(record.key)
        return _frame(
            _PUT_HEAD.pack(_PUT, record.revision, record.session, len(key)) + key + record.value
        )
    if kind is Delete:
        return _frame(_DELETE_HEAD.pack(_DELETE, record.revision) + _text(record.key))
    if kind is SessionOpen:
        return _frame(_SESSION_OPEN_BODY.pack(_SESSION_OPEN, record.session, record.ttl))
    if kind is SessionClose:
        return _frame(_SESSION_CLOSE_BODY.pack(_SESSION_CLOSE, record.session))
    if kind is _PathRevision:
        return _frame(_PATH_REVISION_HEAD.pack(_PATH_REVISION, record.revision) + _text(record.path))
    if kind is _SnapshotMeta:
        return _frame(_SNAPSHOT_META_BODY.pack(_SNAPSHOT_META, *record))
    raise TypeError(f"cannot log {record!r}: not a Put, Delete, SessionOpen or SessionClose")


def _decode(payload: bytes) -> _Record:
    """The record held by a payload whose checksum passed; ValueError if it makes no sense."""
    kind = payload[0] if payload else None
    if kind == _PUT:
        _, revision, session, key_length = _PUT_HEAD.unpack_from(payload)
        key_end = _PUT_HEAD.size + key_length
        if key_end > len(payload):
            raise ValueError(f"key length {key_length} runs past the record")
        key = payload[_PUT_HEAD.size : key_end].decode("utf-8", "surrogatepass")
        return Put(revision, key, payload[key_end:], session)
    if kind == _DELETE:
        (_, revision) = _DELETE_HEAD.unpack_from(payload)
        return Delete(revision, payload[_DELETE_HEAD.size :].decode("utf-8", "surrogatepass"))
    if kind == _SESSION_OPEN:
        _, session, ttl = _SESSION_OPEN_BODY.unpack(payload)
        return SessionOpen(session, ttl)
    if kind == _SESSION_CLOSE:
        return SessionClose(_SESSION_CLOSE_BODY.unpack(payload)[1])
    if kind == _PATH_REVISION:
        (_, revision) = _PATH_REVISION_HEAD.unpack_from(payload)
        path = payload[_PATH_REVISION_HEAD.size :].decode("utf-8", "surrogatepass")
        return _PathRevision(path, revision)
    if kind == _SNAPSHOT_META:
        return _SnapshotMeta(*_SNAPSHOT_META_BODY.unpack(payload)[1:])
    raise ValueError(f"unknown record type {kind}")


def _file_header(magic: bytes, generation: int) -> bytes:
    fields = struct.pack("<8sIQ", magic, FORMAT_VERSION, generation)
    return fields + zlib.crc32(fields).to_bytes(4, "little")


# -- decoding files ------------------------------------------------------------------------------
class _Scan(NamedTuple):
    """The records of one file, and where and why reading stopped early (if it did)."""

    records: list[tuple[int, bytes]]  # (offset, payload)
    end: int  # offset just after the last intact record
    problem: str | None  # what is wrong at ``end``; None if the file ended cleanly
    torn: bool  # whether the damage looks like a write cut short by a crash


def _zeros_from(data: bytes, offset: int) -> bool:
    return data.count(0, offset) == len(data) - offset


def _scan(data: bytes, offset: int) -> _Scan:
    records: list[tuple[int, bytes]] = []
    size = len(data)
    view = memoryview(data)
    while offset < size:
        if size - offset < _RECORD_HEADER.size:
            return _Scan(records, offset, "an incomplete record header", True)
        length, crc, head_crc = _RECORD_HEADER.unpack_from(data, offset)
        if zlib.crc32(view[offset : offset + _LENGTH_CRC.size]) != head_crc:
            problem = "a record header whose checksum does not match"
            return _Scan(records, offset, problem, _zeros_from(data, offset))
        start = offset + _RECORD_HEADER.size
        end = start + length
        if end > size:
            problem = f"a record cut short ({size - start} of its {length} bytes are present)"
            return _Scan(records, offset, problem, True)
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            problem = "a record whose checksum does not match"
            return _Scan(records, offset, problem, end == size or _zeros_from(data, end))
        records.append((offset, payload))
        offset = end
    return _Scan(records, offset, None, False)


def _corrupt(path: Path, offset: int, problem: str, advice: str) -> RendezvousStateError:
    return RendezvousStateError(
        f"{path} is corrupt at byte offset {offset}: {problem}. {advice} "
        "Keep a copy of the data dir before changing anything (see docs/durability.md)."
    )


def _check_header(data: bytes, path: Path, magic: bytes, generation: int) -> None:
    if len(data) < _FILE_HEADER.size or data[:8] != magic:
        raise RendezvousStateError(
            f"{path} is not an rdzv {'log' if magic == _LOG_MAGIC else 'snapshot'} file (its "
            f"first bytes are {data[:8]!r}); move it out of the data dir {path.parent} or point "
            "the server at another data dir"
        )
    _, version, file_generation, crc = _FILE_HEADER.unpack_from(data)
    if zlib.crc32(data[: _FILE_HEADER.size - 4]) != crc:
        raise _corrupt(path, 0, "the file header checksum does not match", "Restore it from a backup.")
    if version > FORMAT_VERSION:
        raise RendezvousStateError(
            f"{path} was written by a newer rdzv (file format {version}; this rdzv reads up to "
            f"format {FORMAT_VERSION}): upgrade rdzv to recover this data dir"
        )
    if file_generation != generation:
        raise _corrupt(
            path, 0, f"its header says generation {file_generation}, its name {generation}",
            "Was it renamed? Give it back its name wal-/snapshot-<generation in its header>.",
        )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}; check the data dir's permissions") from exc


def _read_snapshot(path: Path, generation: int) -> KVState:
    """The state held by a snapshot file; RendezvousStateError if it is damaged in any way."""
    data = _read(path)
    _check_header(data, path, _SNAPSHOT_MAGIC, generation)
    scan = _scan(data, _FILE_HEADER.size)
    advice = (
        "If an older snapshot-*.snap and every wal-*.log from its generation on are in the data "
        "dir, move this snapshot out of it and restart; otherwise restore the data dir from a backup."
    )
    if scan.problem is not None:
        raise _corrupt(path, scan.end, scan.problem, advice)
    state = KVState()
    paths: dict[str, int] = {}
    meta: _SnapshotMeta | None = None
    counts = {_SnapshotMeta: 0, Put: 0, SessionOpen: 0, _PathRevision: 0}
    for offset, payload in scan.records:
        try:
            record = _decode(payload)
        except (ValueError, struct.error) as exc:
            raise _corrupt(path, offset, f"an unreadable record ({exc})", advice) from exc
        kind = type(record)
        if kind not in counts or (meta is None) != (kind is _SnapshotMeta):
            raise _corrupt(path, offset, f"a misplaced {kind.__name__} record", advice)
        counts[kind] += 1
        if kind is _SnapshotMeta:
            meta = record
        elif kind is _PathRevision:
            paths[record.path] = record.revision
        else:
            state.apply(record)
    expected = (1, meta.keys, meta.sessions, meta.paths) if meta else (1, 0, 0, 0)
    if tuple(counts.values()) != expected:
        raise _corrupt(path, scan.end, f"it holds {tuple(counts.values())} records of each "
                       f"kind (meta, keys, sessions, paths) instead of {expected}", advice)
    assert meta is not None
    state.restore_revisions(meta.revision, meta.last_session, paths)
    return state


def _write_snapshot(path: Path, state: KVState, generation: int) -> int:
    """Write ``state`` to ``path`` and fsync it; its size in bytes."""
    items = state.items()
    paths = state.path_revisions()
    sessions = dict(state.session_ttls)
    meta = _SnapshotMeta(state.revision, state.last_session, len(items), len(sessions), len(paths))
    with open(path, "wb") as file:
        file.write(_file_header(_SNAPSHOT_MAGIC, generation))
        file.write(_encode(meta))
        for key, value, session in items:
            file.write(_encode(Put(state.path_revision(key), key, value, session)))
        for session, ttl in sessions.items():
            file.write(_encode(SessionOpen(session, ttl)))
        for name, revision in paths.items():
            file.write(_encode(_PathRevision(name, revision)))
        file.flush()
        os.fsync(file.fileno())
        return file.tell()


# -- files and the directory ---------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock_dir(data_dir: Path) -> int:
    """Create ``data_dir`` if needed and lock it for this process; the lock file's descriptor."""
    lock_path = data_dir / "LOCK"
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(
            f"cannot use data dir {data_dir}: {exc.strerror}; check that it is a writable directory"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreError(
            f"data dir {data_dir} is in use by another rdzv store server (pid {holder}); "
            "stop that server first, or give this one a data dir of its own"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    written = os.write(fd, data)
    if written != len(data):
        view = memoryview(data)
        while written < len(data):
            written += os.write(fd, view[written:])


_sync_data = getattr(os, "fdatasync", os.fsync)


class WriteAheadLog:
    """The log and snapshots of one store server's data dir (see the module docstring).

    Call :meth:`recover` once, then :meth:`append` the effects of each batch of requests and
    :meth:`flush` before acknowledging them; call :meth:`snapshot_if_due` between batches with
    the state that holds exactly the effects appended so far.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        fsync: str = "always",
        snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise StoreValueError(f"fsync must be one of {FSYNC_MODES}, not {fsync!r}")
        if snapshot_bytes <= 0:
            raise StoreValueError(f"snapshot_bytes must be > 0, not {snapshot_bytes}")
        self.data_dir = Path(data_dir)
        self._fsync = fsync == "always"
        self._snapshot_bytes = snapshot_bytes
        self._lock_fd: int | None = _lock_dir(self.data_dir)
        self._log_fd: int | None = None
        self._generation = 0
        self._log_size = 0  # bytes of the current log on disk (header and flushed records)
        self._snapshot_due = snapshot_bytes  # log size at which the next snapshot is written
        self._pending: list[bytes] = []

    # -- recovery -------------------------------------------------------------------------------
    def recover(self) -> KVState:
        """The state saved in the data dir (empty for a new dir); opens the log for appending."""
        if self._lock_fd is None or self._log_fd is not None:
            raise StoreError("recover() must be called once, on an open WriteAheadLog")
        snapshots, logs = self._list_files()
        base = max(snapshots, default=0)
        state = _read_snapshot(snapshots[base], base) if base else KVState()
        snapshot_size = snapshots[base].stat().st_size if base else 0
        chain = sorted(g for g in logs if g >= base)
        for expected, generation in enumerate(chain, start=base):
            if generation != expected:
                raise RendezvousStateError(
                    f"{self._file('wal', expected)} is missing, so {logs[generation]} cannot be "
                    "replayed; restore the missing log from a backup"
                )
        replayed = sum(self._replay(logs[g], g, state, last=g == chain[-1]) for g in chain)
        self._remove_older_than(base)
        if chain:
            self._generation = chain[-1]
            self._log_fd = os.open(logs[chain[-1]], os.O_WRONLY | os.O_APPEND)
        else:
            self._generation = base
            self._log_fd = self._create_log(base)
        self._log_size = os.fstat(self._log_fd).st_size
        self._snapshot_due = max(self._snapshot_bytes, snapshot_size) + _FILE_HEADER.size
        logger.info(
            "recovered %d keys at revision %d from %s (snapshot generation %d, %d log records)",
            state.num_keys(), state.revision, self.data_dir, base, replayed,
        )
        return state

    def _replay(self, path: Path, generation: int, state: KVState, *, last: bool) -> int:
        """Apply the records of one log to ``state``; how many. Cuts a torn tail off the last log."""
        data = _read(path)
        _check_header(data, path, _LOG_MAGIC, generation)
        scan = _scan(data, _FILE_HEADER.size)
        for offset, payload in scan.records:
            try:
                record = _decode(payload)
            except (ValueError, struct.error) as exc:
                raise _corrupt(path, offset, f"an unreadable record ({exc})", "Restore it from a backup.") from exc
            if type(record) not in (Put, Delete, SessionOpen, SessionClose):
                raise _corrupt(path, offset, "a snapshot record inside a log", "Restore it from a backup.")
            state.apply(record)
        if scan.problem is None:
            return len(scan.records)
        if not (scan.torn and last):
            raise _corrupt(
                path, scan.end, scan.problem,
                f"The {len(scan.records)} records before it are intact; the writes after it cannot "
                f"be read. To start from the intact part (losing those writes) run "
                f"`truncate -s {scan.end} {path}` and restart; or restore the data dir from a backup.",
            )
        logger.warning(
            "%s ends with %s at byte offset %d (a write cut short by a crash): dropping its %d "
            "bytes; they were never acknowledged", path, scan.problem, scan.end, len(data) - scan.end,
        )
        os.truncate(path, scan.end)
        with open(path, "rb+") as file:
            os.fsync(file.fileno())
        return len(scan.records)

    def _list_files(self) -> tuple[dict[int, Path], dict[int, Path]]:
        """The snapshots and logs of the data dir by generation; removes unfinished temp files."""
        snapshots: dict[int, Path] = {}
        logs: dict[int, Path] = {}
        for path in self.data_dir.iterdir():
            if _TEMP_NAME.match(path.name):
                path.unlink()
                continue
            match = _FILE_NAME.match(path.name)
            if match and _SUFFIX[match[1]] == match[3]:
                (snapshots if match[1] == "snapshot" else logs)[int(match[2])] = path
        return snapshots, logs

    def _file(self, kind: str, generation: int) -> Path:
        return self.data_dir / f"{kind}-{generation:016d}.{_SUFFIX[kind]}"

    def _create_log(self, generation: int) -> int:
        """Create (atomically, durably) the empty log of ``generation``; its descriptor."""
        path = self._file("wal", generation)
        temp = path.with_suffix(".tmp")
        with open(temp, "wb") as file:
            file.write(_file_header(_LOG_MAGIC, generation))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
        _fsync_dir(self.data_dir)
        return os.open(path, os.O_WRONLY | os.O_APPEND)

    def _remove_older_than(self, generation: int) -> None:
        snapshots, logs = self._list_files()
        for old, path in [*snapshots.items(), *logs.items()]:
            if old < generation:
                path.unlink()

    # -- logging --------------------------------------------------------------------------------
    def append(self, effects: list[Effect]) -> None:
        """Encode ``effects`` into the buffer; :meth:`flush` writes them."""
        pending = self._pending
        for effect in effects:
            pending.append(_encode(effect))

    def flush(self) -> None:
        """Write the buffered records; with ``fsync="always"`` they are on disk when this returns."""
        if not self._pending:
            return
        if self._log_fd is None:
            raise StoreError("the write-ahead log is not open: call recover() first, and not after close()")
        data = b"".join(self._pending)
        self._pending = []
        try:
            _write_all(self._log_fd, data)
            if self._fsync:
                _sync_data(self._log_fd)
        except OSError as exc:
            path = self._file("wal", self._generation)
            try:
                os.ftruncate(self._log_fd, self._log_size)
            except OSError:
                logger.exception("cannot cut the failed write off %s", path)
            raise StoreError(
                f"cannot write the write-ahead log {path}: {exc.strerror}; the last "
                f"{len(data)} bytes of writes are not durable. Free disk space or fix the disk, "
                "then restart the server (it recovers everything acknowledged before)"
            ) from exc
        self._log_size += len(data)

    # -- snapshots ------------------------------------------------------------------------------
    def snapshot_if_due(self, state: KVState) -> None:
        """Write a snapshot of ``state`` if the log has outgrown the threshold.

        A failed snapshot is logged and retried later: the log stays complete meanwhile.
        """
        if self._log_size + sum(map(len, self._pending)) < self._snapshot_due:
            return
        try:
            self.snapshot(state)
        except StoreError:
            self._snapshot_due = self._log_size + self._snapshot_bytes
            logger.exception("snapshot failed; the log keeps every write, will retry later")

    def snapshot(self, state: KVState) -> None:
        """Start a new log, then write a snapshot of ``state`` (which must hold exactly the
        effects appended so far) and remove the older files once it is durable."""
        self.flush()
        if self._log_fd is None:
            raise StoreError("the write-ahead log is not open: call recover() first, and not after close()")
        generation = self._generation + 1
        try:
            log_fd = self._create_log(generation)
        except OSError as exc:
            raise StoreError(f"cannot start log generation {generation} in {self.data_dir}: "
                             f"{exc.strerror}") from exc
        # From here on, the logs of both generations replay in a chain with or without the
        # snapshot, so a failed snapshot loses nothing.
        os.close(self._log_fd)
        self._log_fd = log_fd
        self._generation = generation
        self._log_size = _FILE_HEADER.size
        path = self._file("snapshot", generation)
        temp = path.with_suffix(".tmp")
        try:
            size = _write_snapshot(temp, state, generation)
            os.replace(temp, path)
            _fsync_dir(self.data_dir)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            raise StoreError(f"cannot write snapshot {path}: {exc.strerror}") from exc
        self._snapshot_due = max(self._snapshot_bytes, size) + _FILE_HEADER.size
        self._remove_older_than(generation)
        logger.info("wrote snapshot %s: %d keys at revision %d, %d bytes",
                    path, state.num_keys(), state.revision, size)

    def close(self) -> None:
        """Flush what is buffered and release the files and the data dir's lock."""
        try:
            if self._log_fd is not None:
                self.flush()
        finally:
            for fd in (self._log_fd, self._lock_fd):
                if fd is not None:
                    os.close(fd)
            self._log_fd = self._lock_fd = None

    def __enter__(self) -> "WriteAheadLog":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
