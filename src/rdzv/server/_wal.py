"""Durability of the store server: the data dir, its write-ahead log and its snapshots.

The data dir holds ``LOCK`` (an exclusive ``flock``: one server at a time owns the dir),
``snapshot-<gen>.snap`` (the full state when generation ``gen`` began; none for generation 0)
and ``wal-<gen>.log`` (every effect after that snapshot). Recovery reads the newest snapshot and
replays the logs from its generation on; a torn last record (a crash mid-write) is cut off
with a warning, any other damage raises :class:`RendezvousStateError` naming file and offset.
A snapshot first starts the next log, so the logs replay as a chain whether or not the snapshot
was completed; older files are removed once it is durable. The file format is in
:mod:`rdzv.server._wal_format`; the operator's view in ``docs/durability.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import time
from pathlib import Path
from typing import Callable

from ..errors import RendezvousStateError, StoreError, StoreValueError
from ..kv import KVState, SessionClose
from ._metrics import FSYNC_BUCKETS, Histogram
from ._wal_format import (
    FILE_HEADER_SIZE,
    LOG_MAGIC,
    LogRecord,
    SessionRequest,
    corrupt,
    encode,
    file_header,
    read_log,
    read_snapshot,
    write_snapshot,
)

logger = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_BYTES = 16 * 1024 * 1024
"""Log bytes after which a snapshot is written (or more: at least the last snapshot's size)."""

FSYNC_MODES = ("always", "never")

_FILE_NAME = re.compile(r"^(wal|snapshot)-(\d{16})\.(log|snap)$")
_TEMP_NAME = re.compile(r"^(wal|snapshot)-\d{16}\.tmp$")
_SUFFIX = {"wal": "log", "snapshot": "snap"}
_sync_data = getattr(os, "fdatasync", os.fsync)


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
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreError(
            f"data dir {data_dir} is in use by another rdzv store server (pid {holder}); "
            "stop that server first, or give this one a data dir of its own"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise StoreError(
            f"cannot lock {lock_path}: {exc.strerror}; put the data dir on a local file system"
        ) from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    written = os.write(fd, data)
    while written < len(data):
        written += os.write(fd, memoryview(data)[written:])


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
        self.requests: dict[int, SessionRequest] = {}
        """The last write of each session, as recovered (to answer a write resent after a
        restart without applying it twice)."""
        self._failure: str | None = None  # why writing failed: nothing more is logged after it
        self.bytes_written = 0
        """Bytes of records appended to the log since this server started (its metrics)."""
        self.fsync_seconds = Histogram(FSYNC_BUCKETS)
        """How long each fsync of the log took (with ``fsync="always"``)."""

    # -- recovery -------------------------------------------------------------------------------
    def recover(self) -> KVState:
        """The state saved in the data dir (empty for a new dir); opens the log for appending."""
        if self._lock_fd is None or self._log_fd is not None:
            raise StoreError("recover() must be called once, on an open WriteAheadLog")
        snapshots, logs = self._list_files()
        base = max(snapshots, default=0)  # files of older generations are left over from a crash
        state, self.requests = read_snapshot(snapshots[base], base) if base else (KVState(), {})
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
        self._snapshot_due = max(self._snapshot_bytes, snapshot_size) + FILE_HEADER_SIZE
        logger.info(
            "recovered %d keys at revision %d from %s (snapshot generation %d, %d log records)",
            state.num_keys(), state.revision, self.data_dir, base, replayed,
        )
        return state

    def _replay(self, path: Path, generation: int, state: KVState, *, last: bool) -> int:
        """Apply the records of one log to ``state``; how many. Cuts a torn tail off the last log."""
        effects, scan = read_log(path, generation)
        requests = self.requests
        for effect in effects:
            if isinstance(effect, SessionRequest):
                requests[effect.session] = effect
                continue
            state.apply(effect)
            if isinstance(effect, SessionClose):
                requests.pop(effect.session, None)
        if scan.problem is None:
            return len(effects)
        if not (scan.torn and last):
            raise corrupt(
                path, scan.end, scan.problem,
                f"The {len(effects)} records before it are intact; the writes after it cannot be "
                f"read. To start from the intact part (losing those writes) run "
                f"`truncate -s {scan.end} {path}` and restart; or restore the data dir from a backup.",
            )
        logger.warning(
            "%s ends with %s at byte offset %d (a write cut short by a crash): dropping its last %d "
            "bytes, which were never acknowledged", path, scan.problem, scan.end, scan.size - scan.end,
        )
        os.truncate(path, scan.end)
        with open(path, "rb+") as file:
            os.fsync(file.fileno())
        return len(effects)

    def _list_files(self) -> tuple[dict[int, Path], dict[int, Path]]:
        """The snapshots and logs of the data dir by generation."""
        snapshots: dict[int, Path] = {}
        logs: dict[int, Path] = {}
        for path in self.data_dir.iterdir():
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
            file.write(file_header(LOG_MAGIC, generation))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
        _fsync_dir(self.data_dir)
        return os.open(path, os.O_WRONLY | os.O_APPEND)

    def _remove_older_than(self, generation: int) -> None:
        """Remove the files a durable snapshot of ``generation`` replaced, and unfinished ones."""
        snapshots, logs = self._list_files()
        old = [path for g, path in [*snapshots.items(), *logs.items()] if g < generation]
        for path in old + [p for p in self.data_dir.iterdir() if _TEMP_NAME.match(p.name)]:
            try:
                path.unlink()
            except OSError as exc:
                logger.warning("cannot remove %s (%s); it is ignored from now on", path, exc.strerror)

    # -- logging --------------------------------------------------------------------------------
    def append(self, effects: list[LogRecord]) -> None:
        """Encode ``effects`` (and requests) into the buffer; :meth:`flush` writes them."""
        pending = self._pending
        for effect in effects:
            pending.append(encode(effect))

    def flush(self) -> None:
        """Write the buffered records; with ``fsync="always"`` they are on disk when this returns."""
        if not self._pending:
            return
        fd = self._log_fd
        if fd is None or self._failure is not None:
            raise self._not_writable()
        data = b"".join(self._pending)
        self._pending = []
        try:
            _write_all(fd, data)
            if self._fsync:
                started = time.perf_counter()
                _sync_data(fd)
                self.fsync_seconds.observe(time.perf_counter() - started)
        except OSError as exc:
            path = self._file("wal", self._generation)
            try:
                os.ftruncate(fd, self._log_size)
            except OSError:
                logger.exception("cannot cut the failed write off %s", path)
            self._failure = (
                f"cannot write the write-ahead log {path}: {exc.strerror}; the writes not yet "
                "acknowledged are lost. Free disk space or fix the disk, then restart the server "
                "(it recovers every acknowledged write)"
            )
            raise StoreError(self._failure) from exc
        self._log_size += len(data)
        self.bytes_written += len(data)

    def _not_writable(self) -> StoreError:
        return StoreError(
            self._failure
            or "the write-ahead log is not open: call recover() first, and not after close()"
        )

    # -- snapshots ------------------------------------------------------------------------------
    def snapshot_if_due(
        self, state: KVState, requests: Callable[[], dict[int, SessionRequest]] = dict
    ) -> None:
        """Write a snapshot of ``state`` if the log has outgrown the threshold.

        A failed snapshot is logged and retried later: the log stays complete meanwhile.
        """
        if self._log_size + sum(map(len, self._pending)) < self._snapshot_due:
            return
        try:
            self.snapshot(state, requests())
        except StoreError:
            self._snapshot_due = self._log_size + self._snapshot_bytes
            logger.exception("snapshot failed; the log keeps every write, will retry later")

    def snapshot(self, state: KVState, requests: dict[int, SessionRequest] | None = None) -> None:
        """Start a new log, then write a snapshot of ``state`` (which must hold exactly the
        effects appended so far) with the sessions' last writes ``requests``, and remove the
        older files once it is durable."""
        self.flush()
        old_fd = self._log_fd
        if old_fd is None or self._failure is not None:
            raise self._not_writable()
        generation = self._generation + 1
        try:
            _sync_data(old_fd)  # a log followed by another must be complete on disk
            log_fd = self._create_log(generation)
        except OSError as exc:
            raise StoreError(f"cannot start log generation {generation} in {self.data_dir}: "
                             f"{exc.strerror}") from exc
        # From here on, the logs of both generations replay in a chain with or without the
        # snapshot, so a failed snapshot loses nothing.
        os.close(old_fd)
        self._log_fd = log_fd
        self._generation = generation
        self._log_size = FILE_HEADER_SIZE
        path = self._file("snapshot", generation)
        temp = path.with_suffix(".tmp")
        try:
            size = write_snapshot(temp, state, generation, requests or {})
            os.replace(temp, path)
            _fsync_dir(self.data_dir)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            raise StoreError(f"cannot write snapshot {path}: {exc.strerror}") from exc
        self._snapshot_due = max(self._snapshot_bytes, size) + FILE_HEADER_SIZE
        self._remove_older_than(generation)
        logger.info("wrote snapshot %s: %d keys at revision %d, %d bytes",
                    path, state.num_keys(), state.revision, size)

    def close(self) -> None:
        """Flush what is buffered and release the files and the data dir's lock."""
        try:
            if self._log_fd is not None and self._failure is None:
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
