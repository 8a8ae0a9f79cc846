"""FileStore: a store in one file on a filesystem shared by processes or hosts (NFS, Lustre).

The file is an append-only log of mutations (see ``_fileformat``) guarded by ``flock``. Each
client caches the state in a :class:`KVState` and replays the records written since its last
read. A mutation takes the exclusive lock, catches up, lets the KVState decide (so semantics
match every other store exactly), appends the effects and unlocks. Reads catch up under the
shared lock. When the log outgrows its live data it is compacted into a new file that replaces
the old one (rename); clients notice the new inode and continue from it. Blocking calls poll
with a short exponential backoff (1 ms doubling to 50 ms): the store declares ``watch=False``.
Ephemeral keys live in per-client sessions, see ``_filesession``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, TypeVar

from ..errors import SessionExpiredError, StoreError, StoreTimeoutError, StoreUnsupportedError
from ..kv import DEFAULT_SESSION_TTL, KVState, SessionOpen
from ._base import (
    DEFAULT_TIMEOUT,
    Conditions,
    Store,
    StoreCapabilities,
    Timeout,
    Value,
    check_conditional_write,
    check_key,
    to_bytes,
    to_seconds,
)
from ._fileformat import (
    HEADER_SIZE,
    FileEffect,
    VERSION,
    Header,
    apply_effect,
    decode_header,
    decode_records,
    encode_header,
    encode_record,
    snapshot_effects,
)
from ._filelock import POLL_FIRST, is_current, lock_store_file, open_store_file, sleep_backoff
from ._filesession import (
    LivenessProbe,
    SessionFile,
    process_lock,
    remove_session_file,
    sessions_dir,
    start_heartbeat,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_COMPACT_BYTES = 1 << 20
LOCK_MIN_WAIT = 10.0
"""Seconds a call waits at least for the file lock, however short its own timeout."""

_in_call = threading.local()
"""``depth``: how many FileStore calls the current thread is inside (holding a file lock)."""

class FileStore(Store):
    """torch's ``FileStore(file_name, world_size=-1)``: one file shared by all clients.

    ``world_size > 0``: the file is deleted when the last client closes, once ``world_size``
    clients have opened it. ``session_ttl``: seconds without a heartbeat after which this
    client's ephemeral keys may be removed by others. ``compact_bytes``: the log is compacted
    when the records after the last snapshot exceed both this and the snapshot's size.
    ``read_only``: an observer (``rdzv status``, the web view) that opens no session and writes
    nothing, so a file of an older format stays as it is for the rdzv that runs the job.
    """

    capabilities = StoreCapabilities(
        watch=False, ephemeral=True, listing=True, multi_process=True, conditional=True
    )

    def __init__(
        self,
        file_name: str | os.PathLike[str],
        world_size: int = -1,
        *,
        timeout: Timeout = DEFAULT_TIMEOUT,
        session_ttl: float = DEFAULT_SESSION_TTL,
        compact_bytes: int = DEFAULT_COMPACT_BYTES,
        read_only: bool = False,
    ) -> None:
        super().__init__(timeout)
        path = os.fspath(file_name)  # (TypeError for what is not a path)
        if not path:
            raise ValueError("FileStore needs a file name, e.g. FileStore('/shared/job.store')")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size == 0 or world_size < -1:
            raise ValueError(f"world_size must be a positive int or -1 (unknown), got {world_size!r}")
        if not session_ttl > 0:
            raise ValueError(f"session_ttl must be > 0 seconds, got {session_ttl!r}")
        if isinstance(compact_bytes, bool) or not isinstance(compact_bytes, int) or compact_bytes < 1:
            raise ValueError(f"compact_bytes must be a positive int, got {compact_bytes!r}")
        self.file_name = os.path.realpath(path)
        self.world_size = world_size
        self._session_ttl = float(session_ttl)
        self._compact_bytes = compact_bytes
        self._lock = process_lock(self.file_name)
        self._fd: int | None = None
        self._offset = 0  # next byte to read; 0: header not read yet
        self._header = Header(0, 0, 0)
        self._state = KVState()
        self._last_session = 0
        self._closed = True  # (until the session is open: nothing for close() or __del__ yet)
        self._probe = LivenessProbe(self.file_name)
        self._read_only = read_only
        if read_only:  # an observer: no session, no write (an older format's file stays as is)
            self._session, self._closed = 0, False
            return
        try:
            self._session, self._session_file = self._open_session()
        except BaseException:
            if self._fd is not None:
                os.close(self._fd)
            raise
        self._stop = threading.Event()
        self._heartbeat = start_heartbeat(self, self._stop, self._session_ttl / 3, self._session)
        self._closed = False

    def __del__(self) -> None:
        """The last reference is gone and close() was never called (torch-style code does not
        call it): end the session, stop the heartbeat and, if this was the last of
        ``world_size`` clients, delete the file, as torch's FileStore does in its destructor."""
        if getattr(self, "_closed", True):
            return  # closed, or __init__ failed before the session was opened
        if getattr(_in_call, "depth", 0):
            # Collected inside a FileStore call of this thread, which holds a file lock that
            # closing would wait for: close from a thread of its own (self lives on in it).
            try:
                threading.Thread(target=self.close, name="FileStore close", daemon=True).start()
                return
            except RuntimeError:  # (no new threads at interpreter shutdown)
                pass
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - nothing may escape a finalizer
            logger.warning("FileStore %s: closing the unreferenced store failed: %s",
                           getattr(self, "file_name", "?"), exc)

    # -- the file: lock, catch up, append --------------------------------------------------
    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[KVState]:
        """Hold the file lock with the state caught up to the file's end."""
        patience = max(self._timeout, LOCK_MIN_WAIT)
        deadline = time.monotonic() + patience
        if not self._lock.acquire(timeout=patience):
            raise StoreTimeoutError(
                f"FileStore {self.file_name}: another thread of this process held it {patience:g} s"
            )
        _in_call.depth = getattr(_in_call, "depth", 0) + 1
        try:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            while True:
                if self._fd is None:
                    self._fd, self._offset = open_store_file(self.file_name), 0
                fd = self._fd
                lock_store_file(fd, mode, deadline, self.file_name)
                try:
                    self._catch_up(fd, exclusive)
                    if is_current(fd, self.file_name):
                        yield self._state
                        return
                finally:
                    if self._fd == fd:  # (a compaction inside moved us to a new, unlocked fd)
                        fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)  # replaced by a compacted file, or deleted: move to the new one
                self._fd = None
        finally:
            _in_call.depth -= 1
            self._lock.release()

    def _catch_up(self, fd: int, exclusive: bool) -> None:
        size = os.fstat(fd).st_size
        if self._offset == 0:
            if size == 0:
                if exclusive:
                    self._start_file(fd)
                return
            self._read_header(fd)
        if size > self._offset:
            data = os.pread(fd, size - self._offset, self._offset)
            records, used = decode_records(data, self._offset, self.file_name,
                                           self._header.version)
            for record in records:
                self._apply(record)
            self._offset += used
            if used < len(data) and exclusive:
                logger.warning(
                    "FileStore %s: dropping an incomplete last record at offset %d "
                    "(its writer died while writing it)", self.file_name, self._offset
                )
                os.ftruncate(fd, self._offset)

    def _start_file(self, fd: int) -> None:
        """Write the header of a new, empty store."""
        self._header = Header(random.getrandbits(63) + 1, 0, HEADER_SIZE)
        self._write(fd, encode_header(self._header), 0)
        self._state, self._last_session, self._offset = KVState(), 0, HEADER_SIZE

    def _read_header(self, fd: int) -> None:
        header = decode_header(os.pread(fd, HEADER_SIZE, 0), self.file_name)
        if self._header.file_id and header.parent_id == self._header.file_id:
            self._offset = header.data_start  # compacted from the file we read to its end
        else:
            self._state, self._last_session, self._offset = KVState(), 0, HEADER_SIZE
        self._header = header

    def _apply(self, record: list[FileEffect]) -> None:
        for effect in record:
            apply_effect(self._state, effect)
            if isinstance(effect, SessionOpen):
                self._last_session = max(self._last_session, effect.session)

    def _write(self, fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    def _mutate(self, decide: Callable[[KVState], T]) -> T:
        """Run ``decide`` on the caught-up state under the exclusive lock; log its effects."""
        if self._read_only:
            raise StoreUnsupportedError(f"FileStore {self.file_name} was opened read_only: it "
                                        "writes nothing; open it without read_only to write")
        with self._locked(exclusive=True) as state:
            if self._header.version == VERSION:
                return self._decide_and_log(state, decide)
            self._convert()  # an older format's file: rewritten, then locked anew
        with self._locked(exclusive=True) as state:
            return self._decide_and_log(state, decide)

    def _decide_and_log(self, state: KVState, decide: Callable[[KVState], T]) -> T:
        state.effects = []
        try:
            result = decide(state)
            effects = state.effects
        except BaseException:
            if state.effects:  # decided, then failed: the cache is ahead of the file
                self._forget_cache()
            raise
        finally:
            state.effects = None
        if effects:
            self._append(effects)
        return result

    def _forget_cache(self) -> None:
        """Make the next lock replay the whole file (the cache holds effects it lacks)."""
        self._offset, self._header = 0, Header(0, 0, 0)

    def _append(self, effects: Sequence[FileEffect]) -> None:
        assert self._fd is not None
        for effect in effects:
            if isinstance(effect, SessionOpen):
                self._last_session = max(self._last_session, effect.session)
        try:
            record = encode_record(effects)
            self._write(self._fd, record, self._offset)
        except (OSError, ValueError) as exc:
            self._forget_cache()
            raise StoreError(f"cannot write to FileStore file {self.file_name}: {exc}") from exc
        self._offset += len(record)
        log_bytes = self._offset - self._header.data_start
        if log_bytes > self._compact_bytes and log_bytes > self._header.data_start:
            self._compact()

    def _convert(self) -> None:
        """Rewrite a file of an older format in this one (we hold the exclusive lock). rdzv of
        that older format, still attached, then stops with an error that names the version."""
        if not self._compact():
            self._forget_cache()
            raise StoreError(f"cannot rewrite FileStore file {self.file_name} (format "
                             f"{self._header.version}) in format {VERSION}: see the warning above")
        logger.info("FileStore %s: rewritten in format %d", self.file_name, VERSION)

    def _compact(self) -> bool:
        """Replace the file with a snapshot of the state (we hold the exclusive lock); whether
        it was replaced (else the log stays as it was)."""
        snapshot = encode_record(snapshot_effects(self._state, self._last_session))
        header = Header(random.getrandbits(63) + 1, self._header.file_id, HEADER_SIZE + len(snapshot))
        temp = f"{self.file_name}.compact-{os.getpid()}-{threading.get_ident()}"
        fd = -1
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            self._write(fd, encode_header(header) + snapshot, 0)
            os.fsync(fd)
            os.replace(temp, self.file_name)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
                os.unlink(temp)
            logger.warning("FileStore %s: compaction failed, keeping the log: %s", self.file_name, exc)
            return False
        logger.debug("FileStore %s: compacted to %d bytes", self.file_name, header.data_start)
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd, self._header, self._offset = fd, header, header.data_start
        return True

    # -- sessions ---------------------------------------------------------------------------
    def _open_session(self) -> tuple[int, SessionFile]:
        created: list[SessionFile] = []

        def open_session(state: KVState) -> int:
            session = state.open_session(self._session_ttl)
            created.append(SessionFile(self.file_name, session))
            return session

        try:
            return self._mutate(open_session), created[0]
        except StoreError:
            for session_file in created:
                session_file.remove()
            raise

    def _beat(self) -> None:
        """One heartbeat: touch this client's session file, remove the dead clients' sessions."""
        try:
            self._session_file.touch()
            self._remove_dead_sessions()
        except Exception:  # keep beating: a transient filesystem error must not end the session
            logger.warning("FileStore %s: heartbeat failed", self.file_name, exc_info=True)

    def _remove_dead_sessions(self) -> None:
        with self._locked(exclusive=False) as state:
            sessions = dict(state.session_ttls)
        dead = self._probe.dead_sessions(sessions)
        if dead:
            self._mutate(lambda s: [s.close_session(d) for d in dead if d in s.session_ttls])
            for session in dead:
                remove_session_file(self.file_name, session)

    def _owner(self, ephemeral: bool, state: KVState) -> int:
        if not ephemeral:
            return 0
        if self._session not in state.session_ttls:
            raise SessionExpiredError(
                f"FileStore {self.file_name}: this client's session {self._session} expired "
                f"(no heartbeat for session_ttl={self._session_ttl:g} s, or its process was "
                "stopped); open a new FileStore to write ephemeral keys"
            )
        return self._session

    def close(self) -> None:
        """End this client's session (its ephemeral keys are deleted) and release the file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._read_only:
            self._release()
            return
        self._stop.set()
        if threading.current_thread() is not self._heartbeat:  # (else collected by its beat)
            self._heartbeat.join(timeout=self._session_ttl)
        deleted = False
        try:
            self._remove_dead_sessions()
            deleted = self._mutate(self._close_session)
        finally:
            self._session_file.remove()
            self._release()
        if deleted:
            try:
                os.rmdir(sessions_dir(self.file_name))
            except OSError:
                pass  # a new client already started a new store here

    def _release(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _close_session(self, state: KVState) -> bool:
        """End this client's session; whether it was the last of ``world_size`` (file deleted)."""
        state.close_session(self._session)
        if 0 < self.world_size <= self._last_session and not state.session_ttls:
            os.unlink(self.file_name)  # as torch's FileStore, the last client deletes the file
            return True
        return False

    # -- writes -----------------------------------------------------------------------------
    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        check_key(key)
        data = to_bytes(value)
        self._mutate(lambda s: s.set(key, data, self._owner(ephemeral, s)))

    def add(self, key: str, amount: int) -> int:
        check_key(key)
        amount = int(amount)
        return self._mutate(lambda s: s.add(key, amount))[0]

    def compare_set(
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        check_key(key)
        exp, des = to_bytes(expected), to_bytes(desired)
        return self._mutate(lambda s: s.compare_set(key, exp, des, self._owner(ephemeral, s)))[0]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        checked, data = [check_key(k) for k in keys], [to_bytes(v) for v in values]
        self._mutate(lambda s: s.multi_set(checked, data))

    def multi_set_if(
        self, conditions: Conditions, keys: Sequence[str], values: Sequence[Value]
    ) -> bool:
        checked, names, data = check_conditional_write(conditions, keys, values)
        return self._mutate(lambda s: s.multi_set_if(checked, names, data))[0]

    def append(self, key: str, value: Value) -> None:
        check_key(key)
        data = to_bytes(value)
        self._mutate(lambda s: s.append(key, data))

    def delete_key(self, key: str) -> bool:
        check_key(key)
        return bool(self._mutate(lambda s: s.delete(key)))

    # -- reads ------------------------------------------------------------------------------
    def _read(self, read: Callable[[KVState], T]) -> T:
        with self._locked(exclusive=False) as state:
            return read(state)

    def try_get(self, key: str) -> bytes | None:
        check_key(key)
        return self._read(lambda s: s.get(key))

    def check(self, keys: Sequence[str]) -> bool:
        checked = [check_key(k) for k in keys]
        return self._read(lambda s: all(s.contains(k) for k in checked))

    def num_keys(self) -> int:
        return self._read(KVState.num_keys)

    def list_keys(self, prefix: str) -> dict[str, bytes]:
        return self._read(lambda s: s.list_keys(prefix))

    def count_keys(self, prefix: str) -> int:
        return self._read(lambda s: s.count_keys(prefix))

    def revision(self, path: str = "") -> int:
        return self._read(lambda s: s.path_revision(path))

    def _poll(self, ready: Callable[[KVState], T | None], timeout: float) -> T | None:
        """Poll until ``ready`` returns a value (not None) or ``timeout`` passes (None)."""
        deadline = time.monotonic() + timeout
        delay, seen = POLL_FIRST, -1
        while True:
            with self._locked(exclusive=False) as state:
                result = ready(state)
                offset = self._offset
            if result is not None or time.monotonic() >= deadline:
                return result
            if offset != seen:
                delay, seen = POLL_FIRST, offset
            delay = sleep_backoff(delay, deadline)

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        seconds = to_seconds(timeout, self._timeout)
        def changed(state: KVState) -> int | None:
            current = state.path_revision(path)
            return current if current > since else None

        result = self._poll(changed, seconds)
        return self.revision(path) if result is None else result

    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        def values(state: KVState) -> list[bytes] | None:
            found = [state.get(k) for k in keys]
            return None if None in found else found  # type: ignore[return-value]

        result = self._poll(values, timeout)
        if result is None:
            missing = self._read(lambda s: [k for k in keys if not s.contains(k)])
            raise StoreTimeoutError.waiting_for(missing or keys, timeout)
        return result
