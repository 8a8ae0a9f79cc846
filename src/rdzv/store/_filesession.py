"""FileStore sessions on a shared filesystem: a locked heartbeat file per client, and a liveness probe.

Each client with a session holds ``<store file>.sessions/<id>`` under an exclusive ``flock`` for
its whole life and touches it (mtime) as a heartbeat. Another client tells that the session is
dead when the file is gone, when its lock is free (the process died: the kernel dropped the
lock), or when its mtime has not changed for the session's ttl, measured on the observer's own
monotonic clock (so clock skew between hosts does not matter).
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import socket
import threading
import time
import weakref
from typing import Any

from ..errors import StoreError

logger = logging.getLogger(__name__)

_local_lock = threading.Lock()
_local_sessions: dict[str, set[int]] = {}
"""Live sessions of this process per store file: never probed (POSIX locks, as NFS emulates
flock with, do not exclude the process that holds them)."""


_process_locks: dict[str, threading.RLock] = {}
_process_locks_guard = threading.Lock()


def process_lock(file_name: str) -> threading.RLock:
    """The lock that orders this process's clients of ``file_name`` (flock alone may not)."""
    with _process_locks_guard:
        return _process_locks.setdefault(file_name, threading.RLock())


def sessions_dir(file_name: str) -> str:
    return file_name + ".sessions"


class SessionFile:
    """This client's session file: created locked, touched as a heartbeat, removed at close."""

    def __init__(self, file_name: str, session: int) -> None:
        directory = sessions_dir(file_name)
        self.file_name = file_name
        self.session = session
        self.path = os.path.join(directory, str(session))
        try:
            os.makedirs(directory, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise StoreError(
                f"cannot create the session file {self.path}: {exc.strerror}; the directory of "
                "the FileStore file must be writable"
            ) from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._fd)
            raise StoreError(f"session file {self.path} is locked by another client") from exc
        os.write(self._fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        with _local_lock:
            _local_sessions.setdefault(file_name, set()).add(session)

    def touch(self) -> None:
        """Record a heartbeat: set the file's mtime to now."""
        os.utime(self._fd)

    def remove(self) -> None:
        with _local_lock:
            _local_sessions.get(self.file_name, set()).discard(self.session)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # an observer already judged this session dead and removed it
        os.close(self._fd)


def remove_session_file(file_name: str, session: int) -> None:
    """Remove a dead session's file, if still there."""
    try:
        os.unlink(os.path.join(sessions_dir(file_name), str(session)))
    except FileNotFoundError:
        pass


def _lock_is_free(path: str) -> bool | None:
    """Whether nobody holds ``path``'s lock (None: the file is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


class LivenessProbe:
    """Finds the dead sessions among those a FileStore's state lists."""

    def __init__(self, file_name: str) -> None:
        self.file_name = file_name
        self._directory = sessions_dir(file_name)
        self._heartbeats: dict[int, tuple[int, float]] = {}
        """session -> (last mtime seen, when it was first seen, on our monotonic clock)."""

    def dead_sessions(self, session_ttls: dict[int, float]) -> list[int]:
        with _local_lock:
            local = set(_local_sessions.get(self.file_name, ()))
        now = time.monotonic()
        dead = []
        for session, ttl in session_ttls.items():
            if session in local:
                continue
            reason = self._why_dead(session, ttl, now)
            if reason:
                logger.info("FileStore %s: session %d is dead (%s)", self.file_name, session, reason)
                dead.append(session)
        for session in set(self._heartbeats) - set(session_ttls):
            del self._heartbeats[session]
        return dead

    def _why_dead(self, session: int, ttl: float, now: float) -> str | None:
        path = os.path.join(self._directory, str(session))
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return "its session file is gone"
        seen = self._heartbeats.get(session)
        if seen is None or seen[0] != mtime:
            self._heartbeats[session] = (mtime, now)
        elif ttl > 0 and now - seen[1] > ttl:
            return f"no heartbeat for {now - seen[1]:.1f} s > session_ttl {ttl:g} s"
        free = _lock_is_free(path)
        if free is None:
            return "its session file is gone"
        return "its process released the session lock" if free else None


def heartbeat_loop(ref: "weakref.ref[Any]", stop: threading.Event, interval: float) -> None:
    """The heartbeat thread of a FileStore: a beat every ``interval`` (jittered) until ``stop``
    is set or the store is collected. It holds the store only during a beat, so that dropping
    the last reference releases it (``FileStore.__del__``)."""
    while not stop.wait(interval * random.uniform(0.8, 1.0)):
        store = ref()
        if store is None:
            return
        store._beat()
        del store


def start_heartbeat(
    store: Any, stop: threading.Event, interval: float, session: int
) -> threading.Thread:
    """The started heartbeat thread of FileStore ``store`` (it holds no reference to the store
    between beats: see ``FileStore.__del__``)."""
    thread = threading.Thread(
        target=heartbeat_loop,
        args=(weakref.ref(store), stop, interval),
        name=f"FileStore heartbeat {session}",
        daemon=True,
    )
    thread.start()
    return thread
