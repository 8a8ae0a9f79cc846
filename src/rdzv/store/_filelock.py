"""The FileStore's file as a handle: opened, locked with a deadline (polling, since ``flock``
cannot wait with a timeout), and checked to still be the file at its path (a compaction
replaces it by a rename)."""

from __future__ import annotations

import fcntl
import os
import time

from ..errors import StoreConnectionError, StoreTimeoutError

POLL_FIRST = 0.001
POLL_MAX = 0.05


def sleep_backoff(delay: float, deadline: float) -> float:
    """Sleep ``delay`` (not past ``deadline``); the next, doubled delay."""
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
    return min(delay * 2, POLL_MAX)


def open_store_file(file_name: str) -> int:
    try:
        return os.open(file_name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise StoreConnectionError(
            f"cannot open FileStore file {file_name}: {exc.strerror}; check that its "
            "directory exists and is writable on this host"
        ) from exc


def lock_store_file(fd: int, mode: int, deadline: float, file_name: str) -> None:
    """``flock`` ``fd`` in ``mode`` (shared or exclusive) by ``deadline``, else StoreTimeoutError."""
    delay = POLL_FIRST / 2
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"could not lock FileStore file {file_name} in time: another "
                    "process holds it (hung or stopped?)"
                ) from None
            delay = sleep_backoff(delay, deadline)


def is_current(fd: int, file_name: str) -> bool:
    """Whether ``fd`` is still the file at ``file_name`` (not compacted away or deleted)."""
    try:
        path_stat = os.stat(file_name)
    except FileNotFoundError:
        return False
    fd_stat = os.fstat(fd)
    return (path_stat.st_dev, path_stat.st_ino) == (fd_stat.st_dev, fd_stat.st_ino)
