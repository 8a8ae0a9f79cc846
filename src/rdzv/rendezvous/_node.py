"""What one node holds in a run: a port for its workers' bootstrap store, the keys it wrote, and
a second client of the run's store.

The keys are kept by how long the node needs them (:class:`KeyLedger`): those of the round it
joins, those of its previous round still needed until the new one is sealed, and garbage,
deleted while the node is idle (off the critical path) or when it leaves.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from typing import Callable, Iterable

from ..store import Store


class PortReservation:
    """A TCP port held for this node's workers, without the race of "find a free port, close it".

    The socket is bound with SO_REUSEADDR but never listens: the kernel hands the port to no
    one else (not as an ephemeral port, not to a plain bind), while a server that binds it with
    SO_REUSEADDR -- torch's TCPStore, rdzv's StoreServer, gloo -- can still listen on it.
    """

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, 0))
        except OSError:
            self._sock.bind(("", 0))
        self.port: int = self._sock.getsockname()[1]

    def release(self) -> None:
        self._sock.close()


def new_node_id(host: str) -> str:
    """``host:pid:random``: unique, and the name of this node's keys (no ``/``)."""
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class KeyLedger:
    """The keys one node wrote into its run's store, by how long it still needs them."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._owned: list[str] = []
        """Keys written for the round being joined (the first: the liveness for the next)."""
        self._stale: list[str] = []
        """Keys of the previous round still needed until the current one is sealed."""
        self._garbage: list[str] = []
        """Keys no longer needed, deleted when the node next waits (off the critical path)."""
        self._consumed: list[str] = []
        """Others' keys a seal of this node consumed (leave marks), garbage once it is a member."""

    def joining(self, writes: Iterable[str], stale: list[str]) -> None:
        """The node joins a round with ``writes`` (liveness for the next round first), keeping
        ``stale`` until the round is sealed. What an earlier call left is garbage, except what
        this one writes again (a call that failed and is retried joins under the same keys)."""
        owned = list(writes)
        self._garbage = [
            key for key in dict.fromkeys(self._garbage + self._stale + self._owned)
            if key not in owned and key not in stale
        ]
        self._owned, self._stale = owned, stale

    def consumed(self, keys: list[str]) -> None:
        self._consumed += keys

    def late(self, rank_key: str | None) -> None:
        """Not a member of the round joined: not expected in the next one either."""
        if self._owned:
            self._store.delete_key(self._owned[0])
        self._garbage += self._stale + self._owned[1:] + ([rank_key] if rank_key else [])
        self._stale, self._owned = [], []

    def member(self, rank_key: str) -> None:
        """A member of the round joined: only its liveness for the next round stays; the rest
        was needed to form this one."""
        self.collect()
        self._garbage = self._stale + self._owned[1:] + [rank_key] + self._consumed
        self._consumed, self._stale, self._owned = [], [], self._owned[:1]

    def forget(self) -> None:
        """The session that owned the keys expired: the store dropped its ephemeral keys."""
        self._owned, self._stale = [], []

    def collect(self, through: Store | None = None) -> None:
        """Delete the garbage (``through`` another client of the store)."""
        self._delete(self._garbage, through)
        self._garbage = []

    def leave(self, through: Store | None = None) -> None:
        """Drop out (timed out, closed, leaving): delete every key this node still has
        (``through`` another client of the store: this node's own may be busy)."""
        self._delete(self._owned + self._stale + self._garbage, through)
        self._owned, self._stale, self._garbage = [], [], []

    def _delete(self, keys: list[str], through: Store | None = None) -> None:
        store = through or self._store
        for key in keys:
            store.delete_key(key)


class SideClient:
    """A second client of the run's store, opened on first use, for the calls that must not
    wait behind this node's blocking round watch on a store whose client serves one call at a
    time (TCPStore): queries while the node joins a round, and the history's background writes.
    Without an ``opener`` (etcd, file: their clients serve concurrent calls) it is the node's
    own client."""

    def __init__(self, store: Store, opener: Callable[[], Store] | None) -> None:
        self._store = store
        self.opener = opener
        self.opened: Store | None = None
        self._lock = threading.Lock()

    def get(self, joining: bool = True) -> Store:
        """The client for a call made while the node joins (``joining``), else its own."""
        if self.opener is None or not joining:
            return self._store
        with self._lock:
            if self.opened is None:
                self.opened = self.opener()
            return self.opened

    def close(self) -> None:
        if self.opened is not None:
            self.opened.close()
