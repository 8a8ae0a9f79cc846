"""The keepalive thread: one per process, pinging the idle connections of every TCPStore.

A connection idle for ``session_ttl / 3`` seconds gets a ping, so that the server never takes a
live but quiet client for dead (see :mod:`._tcp_conn`). The thread sleeps until the next ping is
due; a store registered with an earlier due time wakes it.
"""

from __future__ import annotations

import threading
import time
import weakref

from ._tcp_conn import StoreConnection

_monotonic = time.monotonic


class Keepalive:
    """One thread per process pinging the idle connections of every TCPStore."""

    def __init__(self) -> None:
        self._stores: "weakref.WeakSet[StoreConnection]" = weakref.WeakSet()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wake_at = 0.0
        """When the thread wakes next: a store registered with an earlier ping due wakes it."""

    def register(self, store: StoreConnection) -> None:
        with self._cond:
            self._stores.add(store)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rdzv-store-keepalive", daemon=True)
                self._thread.start()
            elif store._keepalive_due() < self._wake_at:
                self._cond.notify()  # not for every store: each wake-up visits all of them

    def unregister(self, store: StoreConnection) -> None:
        with self._cond:
            self._stores.discard(store)

    def _run(self) -> None:
        while True:
            with self._cond:
                stores = list(self._stores)
            now = _monotonic()
            next_due = now + 1.0
            for store in stores:
                due = store._keepalive_due()
                if due <= now:
                    store._keepalive()
                    due = store._keepalive_due()
                    if due <= now:  # busy: its own call is on the wire
                        due = now + 0.05
                if due < next_due:
                    next_due = due
            del stores
            with self._cond:
                self._wake_at = next_due
                self._cond.wait(max(0.005, next_due - _monotonic()))


KEEPALIVE = Keepalive()
"""The keepalive of this process."""

