"""The keepalive thread: one per process, pinging the idle connections of every TCPStore.

A connection idle for ``session_ttl / 3`` seconds gets a ping, so that the server never takes a
live but quiet client for dead (see :mod:`._tcp_conn`: each connection registers itself when
opened). The thread sleeps until the next ping is due; a connection registered with an earlier
due time wakes it.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Protocol

_monotonic = time.monotonic


class Pinged(Protocol):
    """What the keepalive asks of a connection (a :class:`~._tcp_conn.StoreConnection`)."""

    def keepalive_in(self) -> float:
        """Seconds until the connection wants a ping (by its own clock; <= 0: now)."""

    def keepalive(self) -> None:
        """Ping the server if the connection is idle (never blocking on a call under way)."""


class Keepalive:
    """One thread per process pinging the idle connections of every TCPStore."""

    def __init__(self) -> None:
        self._conns: "weakref.WeakSet[Pinged]" = weakref.WeakSet()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wake_at = 0.0
        """When the thread wakes next: a connection registered with an earlier ping due wakes it."""

    def register(self, conn: Pinged) -> None:
        with self._cond:
            self._conns.add(conn)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rdzv-store-keepalive", daemon=True)
                self._thread.start()
            elif _monotonic() + conn.keepalive_in() < self._wake_at:
                self._cond.notify()  # not for every connection: each wake-up visits all of them

    def unregister(self, conn: Pinged) -> None:
        with self._cond:
            self._conns.discard(conn)

    def _run(self) -> None:
        while True:
            with self._cond:
                conns = list(self._conns)
            now = _monotonic()
            next_due = now + 1.0
            for conn in conns:
                due_in = conn.keepalive_in()
                if due_in <= 0:
                    conn.keepalive()
                    due_in = conn.keepalive_in()
                    if due_in <= 0:  # busy: its own call is on the wire
                        due_in = 0.05
                next_due = min(next_due, now + due_in)
            del conns
            with self._cond:
                self._wake_at = next_due
                self._cond.wait(max(0.005, next_due - _monotonic()))


KEEPALIVE = Keepalive()
"""The keepalive of this process."""

