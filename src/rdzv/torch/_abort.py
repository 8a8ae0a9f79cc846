"""Unblocking a process group whose peer is gone: a collective waiting on a dead or hung peer
must fail now, not after the group's timeout (10 minutes by default).

NCCL communicators are aborted with the backend's ``abort()`` (``ncclCommAbort``). Gloo has no
abort that wakes a pending collective (torch 2.13's ``ProcessGroupGloo.abort()`` returns at once
and the collective still waits), so the sockets the group opened are shut down instead: every
read or write on them fails, and gloo raises in the waiting collective. The group's sockets are
the connected (not listening) ones that appeared in the process while it was created
(:class:`GroupSockets`), also while a creation is still under way (a new group waiting in its
store for a peer that is gone); a socket is shut down only if its descriptor still names the
same socket (not a later reuse of the number), and never the channel to the agent.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
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


def abort_communicator(group: dist.ProcessGroup, device: torch.device) -> None:
    """Abort ``group``'s NCCL communicator (``ncclCommAbort``): its pending work fails."""
    try:
        group._get_backend(device).abort()
    except (RuntimeError, AttributeError) as exc:
        logger.warning("cannot abort the NCCL communicators: %s", exc)


class GroupSockets:
    """The sockets of this process's process groups, to shut down when the group must be aborted:
    those of the current group, and those a group being created (or its store being prepared)
    has opened so far, so an abort also fails a creation waiting on a lost peer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tracked: dict[int, str] = {}
        self._creating: dict[int, dict[int, str]] = {}
        self._excluded: set[str] = set()
        self._aborted: set[str] = set()
        """The sockets the last abort shut down."""
        self.aborts = 0
        """How many aborts so far: a creation that began before the last one must not go on."""

    def exclude(self, sock: socket.socket) -> None:
        """Never shut ``sock`` down (the channel to the agent)."""
        link = _sockets().get(sock.fileno())
        if link is not None:
            self._excluded.add(link)

    @contextmanager
    def recording(self, track: bool = True) -> Iterator[None]:
        """Track the sockets that appear while the block creates a group (or its store); with
        ``track`` False, an abort meanwhile shuts them down, but they are not this recorder's
        once made (a group another recorder keeps: the node group, ``_nodegroup``)."""
        before = _sockets()
        token = id(before)
        with self._lock:
            self._creating[token] = before
        try:
            yield
        finally:
            appeared = {fd: link for fd, link in _sockets().items() if before.get(fd) != link}
            with self._lock:
                del self._creating[token]
                if track:
                    self._tracked.update(appeared)

    def forget_closed(self) -> None:
        """Drop the sockets that are closed now (a destroyed group's)."""
        current = _sockets()
        with self._lock:
            self._tracked = {fd: link for fd, link in self._tracked.items()
                             if current.get(fd) == link}

    def abort(self) -> int:
        """Abort every group: NCCL's communicators, the sockets of gloo, of the groups' stores
        and of any group being created. Returns how many sockets were shut down."""
        with self._lock:
            self.aborts += 1
            targets = {**self._tracked, **self._opened_by_creations()}
            self._aborted = set(targets.values())
        if dist.is_initialized() and dist.get_backend() == "nccl":
            abort_communicator(dist.group.WORLD, torch.device("cuda"))  # type: ignore[arg-type]
        return self._shut_down(targets)

    def cut_creations(self) -> int:
        """Shut down the sockets that the group creations under way opened since the last abort
        (not an abort: nothing else is touched, the abort count stays): a creation that
        outlived an abort reconnected (torch's store client retries a connection it lost) and
        waits on peers that went on without it. Returns how many sockets were shut down."""
        with self._lock:
            targets = {fd: link for fd, link in self._opened_by_creations().items()
                       if link not in self._aborted}
        return self._shut_down(targets)

    def _opened_by_creations(self) -> dict[int, str]:
        """(Lock held.) The sockets that appeared since each creation under way began."""
        if not self._creating:
            return {}
        current, opened = _sockets(), {}
        for before in self._creating.values():
            opened.update({fd: link for fd, link in current.items() if before.get(fd) != link})
        return opened

    def close_current(self) -> int:
        """Shut down the current group's sockets as this worker leaves it for a new one (not an
        abort: its own work in it is done): a peer still waiting in the old group (it took the
        plan late) fails at once rather than after the group's timeout. NCCL's communicators
        are left to ``destroy_process_group``, which waits for their queued work."""
        with self._lock:
            targets = dict(self._tracked)
        return self._shut_down(targets)

    def _shut_down(self, targets: dict[int, str]) -> int:
        """Shut down the connected TCP sockets among ``targets`` (fd -> link) that still are
        what they were; the count."""
        count = 0
        for fd, link in targets.items():
            if link in self._excluded:
                continue
            try:
                if os.readlink(os.path.join(_FD_DIR, str(fd))) != link:
                    continue  # closed, and the number reused since
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                if sock.family in (socket.AF_INET, socket.AF_INET6) and \
                        sock.type == socket.SOCK_STREAM and not listening:
                    sock.shutdown(socket.SHUT_RDWR)  # a listener's accept() would abort gloo
                    count += 1
            except OSError:
                pass
            finally:
                sock.close()
        return count
