"""The server's event loop: epoll readiness, a heap of timers and a wake-up fd, nothing else.

:class:`EventLoop` runs in one thread. Each registered file descriptor has a handler object
whose ``on_event(events)`` is called when epoll reports it ready (level-triggered); timers are
kept in a heap and cancelled lazily; other threads (``stop``, signal handlers) wake the loop
through an eventfd (a socketpair where there is none). After every round of events and timers
the loop calls its ``after_round`` hook: the server answers and commits there, so that all
the requests read in one round share one write-ahead log flush and one send per connection.
"""

from __future__ import annotations

import heapq
import logging
import os
import select
import socket
import time
from typing import Any, Callable, Protocol

log = logging.getLogger("rdzv.server")

EPOLLIN = select.EPOLLIN
EPOLLOUT = select.EPOLLOUT
EPOLLERR = select.EPOLLERR
EPOLLHUP = select.EPOLLHUP
READABLE = EPOLLIN | EPOLLERR | EPOLLHUP
_MAX_EVENTS = 1024
_monotonic = time.monotonic


def readable(fd: int) -> bool:
    """Whether bytes (or the end of the stream) wait unread on the socket ``fd``."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return False


class Handler(Protocol):
    def on_event(self, events: int) -> None: ...


class Timer:
    """A callback due at ``when`` (loop time); :meth:`cancel` before it runs drops it."""

    __slots__ = ("when", "callback", "args", "cancelled")

    def __init__(self, when: float, callback: Callable[..., Any], args: tuple) -> None:
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.args = ()

    def __lt__(self, other: "Timer") -> bool:
        return self.when < other.when


class _Waker:
    """The read end of the loop's wake-up channel: drains it when the loop is woken."""

    def __init__(self) -> None:
        eventfd = getattr(os, "eventfd", None)
        if eventfd is not None:
            self.fd = eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._wfd = self.fd
            self._pair: tuple[socket.socket, socket.socket] | None = None
            self._token = (1).to_bytes(8, "little")
        else:  # pragma: no cover - platforms without eventfd
            rsock, wsock = socket.socketpair()
            rsock.setblocking(False)
            wsock.setblocking(False)
            self._pair = (rsock, wsock)
            self.fd, self._wfd = rsock.fileno(), wsock.fileno()
            self._token = b"\x01"

    def wake(self) -> None:
        try:
            os.write(self._wfd, self._token)
        except (BlockingIOError, OSError):
            pass  # already woken (or closing)

    def on_event(self, events: int) -> None:
        try:
            os.read(self.fd, 4096)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        if self._pair is not None:
            for sock in self._pair:
                sock.close()
        else:
            os.close(self.fd)


class EventLoop:
    """A minimal single-threaded epoll loop (see the module docstring)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._handlers: dict[int, Callable[[int], None]] = {}
        """Each registered fd's ``on_event``."""
        self._timers: list[Timer] = []
        self._next_compaction = 0.0
        self._soon: list[tuple[Callable[..., Any], tuple]] = []
        self._stopping = False
        self._waker = _Waker()
        self.register(self._waker.fd, EPOLLIN, self._waker)
        self.after_round: Callable[[], None] = lambda: None
        self.time = _monotonic

    # -- file descriptors ---------------------------------------------------------------------
    def register(self, fd: int, events: int, handler: Handler) -> None:
        self._epoll.register(fd, events)
        self._handlers[fd] = handler.on_event

    def modify(self, fd: int, events: int) -> None:
        self._epoll.modify(fd, events)

    def unregister(self, fd: int) -> None:
        if self._handlers.pop(fd, None) is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    # -- callbacks ----------------------------------------------------------------------------
    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Timer:
        timer = Timer(when, callback, args)
        heapq.heappush(self._timers, timer)
        return timer

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer:
        return self.call_at(_monotonic() + delay, callback, *args)

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback`` after this round's events, or, when called from a callback of
        this kind, in the next round (so that such work takes turns with the events; loop
        thread only)."""
        self._soon.append((callback, args))

    def stop(self) -> None:
        """Make :meth:`run` return after the current round; safe from any thread or a signal
        handler."""
        self._stopping = True
        self._waker.wake()

    # -- running ------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve events and timers until :meth:`stop`."""
        poll = self._epoll.poll
        handlers = self._handlers
        timers = self._timers
        self._stopping = False
        while not self._stopping:
            if self._soon:
                timeout = 0.0
            elif timers:
                timeout = timers[0].when - _monotonic()
                if timeout < 0.0:
                    timeout = 0.0
            else:
                timeout = -1.0
            for fd, events in poll(timeout, _MAX_EVENTS):
                on_event = handlers.get(fd)
                if on_event is not None:
                    on_event(events)
            if timers and timers[0].when <= _monotonic():
                self._run_timers()
            if self._soon:  # one pass: what these schedule runs next round, after new events
                soon, self._soon = self._soon, []
                for callback, args in soon:
                    callback(*args)
            self.after_round()

    def _run_timers(self) -> None:
        timers = self._timers
        now = _monotonic()
        while timers and timers[0].when <= now:
            timer = heapq.heappop(timers)
            if not timer.cancelled:
                timer.callback(*timer.args)
        if len(timers) > 1024 and now >= self._next_compaction:
            # Cancelled timers stay in the heap until due; drop them when they are the most.
            self._next_compaction = now + 1.0
            live = [t for t in timers if not t.cancelled]
            if 2 * len(live) < len(timers):
                timers[:] = live
                heapq.heapify(timers)

    def close(self) -> None:
        """Release the epoll object and the wake-up channel (the handlers' fds are theirs)."""
        self._handlers.clear()
        self._timers.clear()
        self._epoll.close()
        self._waker.close()
