"""The agent keys of a round that outlive a transition: each node's sign of life, its leave, its
success, and the port it holds for a new group's store; and who serves the store.

The keys a round's transition is agreed with (records, the decision, assignments) are
``_records.py``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..rendezvous import (
    AGENT_ALIVE,
    AGENT_LEAVING,
    AGENT_STRAGGLERS,
    PortReservation,
    RendezvousInfo,
)
from ..store import Store

logger = logging.getLogger(__name__)

DONE_DIR = "agent/done/"
ALIVE_DIR = AGENT_ALIVE
"""Each node's ephemeral sign of life in its round's store: the wall time it last wrote it."""
LEAVING_DIR = AGENT_LEAVING
"""A node leaving gracefully writes its group rank here before it withdraws from the next round."""
SEEN_DIR = "agent/seen/"
"""The same sign of life as ``ALIVE_DIR`` but lasting: when a node's alive entry vanishes, how
long it had been silent tells a lost connection from missed heartbeats (the history)."""
STRAGGLER_DIR = AGENT_STRAGGLERS
"""Group rank 0 flags a straggler here: its group rank -> the ratio of its work to the others'."""
EVICT_DIR = "agent/evict/"
"""Group rank 0 asks a node (its group rank) to leave for a spare here; the node reads it."""
HEARTBEAT_EVERY = 5.0
"""Seconds between refreshes of a node's ``ALIVE_DIR`` entry while its workers run."""


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
    gone when its store session ends (its lasting copy, ``SEEN_DIR``, stays: one message with
    the alive entry)."""
    stamp = json.dumps({"time": time.time(), **(perf or {})})
    with info.store.batch():
        info.store.set(f"{ALIVE_DIR}{info.rank}", stamp, ephemeral=True)
        info.store.set(f"{SEEN_DIR}{info.rank}", stamp)


def mark_done(info: RendezvousInfo) -> None:
    """Mark this node as finished in its round; marking it again changes nothing."""
    info.store.set(f"{DONE_DIR}{info.rank}", b"1")


def all_done(info: RendezvousInfo) -> bool:
    """Whether every node of the round has finished."""
    return info.store.count_keys(DONE_DIR) >= info.world_size


def hosts_store(store: Store) -> bool:
    """Whether ``store`` (or the store under a PrefixStore) is served from this process."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return getattr(store, "server", None) is not None


def wait_until_others_left(info: RendezvousInfo, timeout: float) -> None:
    """On the node serving the store: wait (at most ``timeout`` s) until the sessions of the
    round's other nodes have ended, since they still use the store until they leave."""
    store = info.store
    if not hosts_store(store):
        return
    deadline = time.monotonic() + timeout
    while True:
        since = store.revision(ALIVE_DIR)
        if store.count_keys(ALIVE_DIR) <= 1:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            logger.warning("not every node left within %.3g s", timeout)
            return
        store.watch(ALIVE_DIR, since, remaining)
