"""The agent keys of a round that outlive a transition: each node's sign of life, its leave, its
success, and the port it holds for a new group's store; and who serves the store.

The keys a round's transition is agreed with (records, the decision, assignments) are
``_records.py``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from ..rendezvous import (
    AGENT_ALIVE,
    AGENT_DONE,
    AGENT_SEEN,
    PortReservation,
    RendezvousHandler,
    RendezvousInfo,
)
from ..store import Store

logger = logging.getLogger(__name__)

STOP_POLL = 0.5
"""The longest single wait of :func:`wait_until_others_left` before it looks for a signal."""
HEARTBEAT_EVERY = 5.0
"""Seconds between refreshes of a node's ``AGENT_ALIVE`` entry while its workers run."""


_workers_port: PortReservation | None = None
"""The port this node holds in its current round for the store of a new group."""


def reserve_workers_port(addr: str) -> int:
    """Hold a port for a new group's store until the next round (without a bind race)."""
    global _workers_port
    if _workers_port is not None:
        _workers_port.release()
    _workers_port = PortReservation(addr)
    return _workers_port.port


def mark_alive(info: RendezvousInfo, perf: dict[str, Any] | None = None) -> None:
    """Write this node's sign of life (the time now, and ``perf``: its workers' step times);
    gone when its store session ends (its lasting copy, ``AGENT_SEEN``, stays: one message with
    the alive entry)."""
    stamp = json.dumps({"time": time.time(), **(perf or {})})
    with info.store.batch():
        info.store.set(f"{AGENT_ALIVE}{info.rank}", stamp, ephemeral=True)
        info.store.set(f"{AGENT_SEEN}{info.rank}", stamp)


def mark_done(info: RendezvousInfo) -> None:
    """Mark this node as one its round's end does not wait for (its workers finished the job,
    or none of them is in the group); marking it again changes nothing."""
    info.store.set(f"{AGENT_DONE}{info.rank}", b"1")


def all_done(info: RendezvousInfo) -> bool:
    """Whether every node of the round has finished."""
    return info.store.count_keys(AGENT_DONE) >= info.world_size


def hosts_store(store: Store) -> bool:
    """Whether ``store`` (or the store under a PrefixStore) is served from this process."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return getattr(store, "server", None) is not None


def wait_until_others_left(info: RendezvousInfo, handler: RendezvousHandler,
                           timeout: float, stop: Callable[[], bool] = lambda: False) -> None:
    """On the node serving the store: wait (at most ``timeout`` s in all) until the sessions of
    the round's other nodes have ended, since they still use the store until they leave; then,
    if the run is closed, until no node waits for a next round: a spare learns of the close in
    the store and leaves, and a store gone before it looked would hold it for the store's whole
    read timeout, then leave it unsure whether the job had ended. Real waits on the store: the
    system's clock, in slices of at most ``STOP_POLL`` s: ``stop()`` (a signal came) ends it."""
    store = info.store
    if not hosts_store(store):
        return
    started = time.monotonic()
    deadline = started + timeout
    while True:
        since = store.revision(AGENT_ALIVE)
        if store.count_keys(AGENT_ALIVE) <= 1:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            logger.warning("not every node left within %.3g s", timeout)
            return
        if stop():
            return
        store.watch(AGENT_ALIVE, since, min(remaining, STOP_POLL))
    if not handler.is_closed():
        return
    since = 0
    while True:
        if stop():
            return
        seen = handler.membership(since, min(STOP_POLL, max(0.0, deadline - time.monotonic())))
        if seen is None or seen[0].waiting == 0:  # (None: a backend without counts)
            return
        if time.monotonic() >= deadline:
            logger.warning("a node still waits for a round of the closed run after %.3g s; "
                           "the store goes anyway", time.monotonic() - started)
            return
        since = seen[1]
