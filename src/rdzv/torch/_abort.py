"""Unblocking a process group whose peer is gone: a collective waiting on a dead or hung peer
must fail now, not after the group's timeout (10 minutes by default).

NCCL communicators are aborted with the backend's ``abort()`` (``ncclCommAbort``). Gloo has no
abort that wakes a pending collective (torch 2.13's ``ProcessGroupGloo.abort()`` returns at once
and the collective still waits), so the sockets the group opened are shut down instead: every
read or write on them fails, and gloo raises in the waiting collective. The group's sockets are
the connected (not listening) ones that appeared in the process while it was created
(:class:`GroupSockets`); a socket is shut down only if its descriptor still names the same
socket (not a later reuse of the number).
"""

from __future__ import annotations

import logging
import os
import socket
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_FD_DIR = "/proc/self/fd"


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> ``socket:[inode]``."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(os.path.join(_FD_DIR, name))
        except OSError:
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


class GroupSockets:
    """The sockets of the current process group, to shut down when it must be aborted."""

    def __init__(self) -> None:
        self._fds: dict[int, str] = {}

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Note the sockets that appear while the block creates a process group."""
        before = _sockets()
        try:
            yield
        finally:
            self._fds = {fd: link for fd, link in _sockets().items() if before.get(fd) != link}

    def abort(self) -> int:
        """Abort the current group: NCCL's communicators, gloo's sockets. Returns how many
        sockets were shut down."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            try:
                dist.group.WORLD._get_backend(torch.device("cuda")).abort()  # type: ignore[union-attr]
            except (RuntimeError, AttributeError) as exc:
                logger.warning("cannot abort the NCCL communicators: %s", exc)
        count = 0
        for fd, link in self._fds.items():
            try:
                if os.readlink(os.path.join(_FD_DIR, str(fd))) != link:
                    continue  # closed, and the number reused since
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                if sock.type == socket.SOCK_STREAM and not listening:
                    sock.shutdown(socket.SHUT_RDWR)  # a listener's accept() would abort gloo
                    count += 1
            except OSError:
                pass
            finally:
                sock.close()
        self._fds = {}
        return count
