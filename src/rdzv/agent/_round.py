"""This node's part in a round: its global ranks and master address, and watching the membership.

After a round forms, each node writes what it runs (``nproc``, role) to the round's store and
reads back its :class:`Assignment`. Rank 0 alone reads every node's entry, computes the prefix
sums once and writes each node its own offsets (one ``multi_set``), so every other node does one
write and one read whatever the number of nodes. The workers' MASTER_ADDR/MASTER_PORT is the
rendezvous's ``bootstrap_store_info`` (rank 0's address and a port it found free), or, when that
names the agent's own store, a free port rank 0 picks and publishes in the same write.

:class:`MembershipWatcher` waits on ``wait_for_membership_change`` in a thread and reports the
first change of a round as one :class:`MembershipChanged` event.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import RendezvousError, RendezvousStateError
from ..rendezvous import RendezvousHandler, RendezvousInfo
from ..rendezvous._engine import PortReservation
from ..rendezvous._status import AGENT_ALIVE, AGENT_LEAVING
from ..rendezvous._status import AGENT_NODES as NODE_KEY
from ..store import Store

logger = logging.getLogger(__name__)

ASSIGN_KEY = "agent/assign/"
DONE_DIR = "agent/done/"
ALIVE_DIR = AGENT_ALIVE
"""Each node's ephemeral sign of life in its round's store: the wall time it last wrote it."""
LEAVING_DIR = AGENT_LEAVING
"""A node leaving gracefully writes its group rank here before it withdraws from the next round."""
CAPABLE_DIR = "agent/inprocess/"
"""A node whose workers all use the in-process API (connected to their agent) says so here."""
MODE_KEY = "agent/mode"
"""Group rank 0's word on how the round starts: restart the workers, or switch in-process."""
READY_DIR = "agent/ready/"
"""In-process: a node whose workers are ready for the switch (newcomers: started and connected)."""
SWITCH_KEY = "agent/switch"
"""How the members of a round (and a node leaving it) move to the next one: the step at which
they switch in-process, or that the workers restart; written into the round's store by group
rank 0 of the next round."""
JOIN_KEY = "agent/join"
"""The same decision in the new round's store, for its newcomers."""
SEEN_DIR = "agent/seen/"
"""The same sign of life as ``ALIVE_DIR`` but lasting: when a node's alive entry vanishes, how
long it had been silent tells a lost connection from missed heartbeats (the history)."""
HEARTBEAT_EVERY = 5.0
"""Seconds between refreshes of a node's ``ALIVE_DIR`` entry while its workers run."""


_workers_port: PortReservation | None = None
"""The port group rank 0 holds for its workers' master when the rendezvous offers none."""


def reserve_workers_port(addr: str) -> int:
    """Hold a port for this node's workers until the next round (without a bind race)."""
    global _workers_port
    if _workers_port is not None:
        _workers_port.release()
    _workers_port = PortReservation(addr)
    return _workers_port.port


@dataclass(frozen=True)
class Assignment:
    """This node's place among all workers of a round."""

    group_rank: int
    group_world_size: int
    rank_offset: int
    """Global rank of this node's local rank 0."""
    world_size: int
    role_rank_offset: int
    role_world_size: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class MembershipChanged:
    """Event: a member of round ``generation`` was lost, left, or a node is waiting to join."""

    generation: int


def loads_entry(key: str, raw: bytes) -> dict[str, Any]:
    """An agent key's JSON object, or RendezvousStateError naming the key."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise RendezvousStateError(f"agent key {key!r} does not hold agent JSON: {raw[:60]!r}")
    return data


def plan_assignments(nodes: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """Offsets of each node (given as (nproc, role) in group-rank order): global and per role."""
    world_size = sum(nproc for nproc, _ in nodes)
    role_sizes: dict[str, int] = {}
    for nproc, role in nodes:
        role_sizes[role] = role_sizes.get(role, 0) + nproc
    offset, role_offsets = 0, dict.fromkeys(role_sizes, 0)
    plans: list[dict[str, Any]] = []
    for nproc, role in nodes:
        plans.append({"offset": offset, "world": world_size, "role_offset": role_offsets[role],
                      "role_world": role_sizes[role]})
        offset += nproc
        role_offsets[role] += nproc
    return plans


def assign(info: RendezvousInfo, handler: RendezvousHandler, nproc: int, role: str,
           host: str, timeout: float, join_seconds: float,
           max_nodes: int | None = None) -> Assignment:
    """Exchange (nproc, role) through the round's store and return this node's assignment.

    The entry also says who this node is, how long its join took and the job's ``max_nodes``,
    for ``rdzv status``.

    Raises:
        StoreTimeoutError: a node of the round did not write its entry (or rank 0 its answer)
            within ``timeout`` seconds (it probably died: the caller re-rendezvouses).
        SessionExpiredError: this node's store session expired as the round formed (it was
            paused past its session ttl): the others take it for gone, the caller re-rendezvouses.
    """
    store: Store = info.store
    store.set_timeout(timeout)
    rank, size = info.rank, info.world_size
    entry = {"nproc": nproc, "role": role, "host": host, "pid": os.getpid(), "time": time.time(),
             "join_s": round(join_seconds, 6), "max_nodes": max_nodes,
             "node_id": getattr(handler, "node_id", None)}
    store.set(f"{NODE_KEY}{rank}", json.dumps(entry))
    store.delete_key(f"{DONE_DIR}{rank}")  # a static node restarted after it had finished
    mark_alive(info)
    if rank == 0:
        keys = [f"{NODE_KEY}{g}" for g in range(size)]
        entries = [loads_entry(k, raw) for k, raw in zip(keys, store.multi_get(keys))]
        plans = plan_assignments([(int(e["nproc"]), str(e["role"])) for e in entries])
        bootstrap = info.bootstrap_store_info
        if bootstrap is not None and not handler.use_agent_store:
            addr, port = bootstrap.master_addr, bootstrap.master_port
        else:  # the bootstrap address is the agent's own store: the workers need their own port
            addr = bootstrap.master_addr if bootstrap is not None else host
            port = reserve_workers_port(addr)
        for plan in plans:
            plan.update(addr=addr, port=port)
        store.multi_set([f"{ASSIGN_KEY}{g}" for g in range(size)],
                        [json.dumps(plan) for plan in plans])
        mine = plans[0]
    else:
        key = f"{ASSIGN_KEY}{rank}"
        mine = loads_entry(key, store.get(key))
    return Assignment(
        group_rank=rank,
        group_world_size=size,
        rank_offset=int(mine["offset"]),
        world_size=int(mine["world"]),
        role_rank_offset=int(mine["role_offset"]),
        role_world_size=int(mine["role_world"]),
        master_addr=str(mine["addr"]),
        master_port=int(mine["port"]),
    )


def mark_alive(info: RendezvousInfo) -> None:
    """Write this node's sign of life (the time now); gone when its store session ends (its
    lasting copy, ``SEEN_DIR``, stays: one message with the alive entry)."""
    stamp = json.dumps({"time": time.time()})
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


class MembershipWatcher:
    """A thread reporting the first membership change of a round (then it ends).

    It is the only thread that blocks on the store while the workers run: a TCPStore has one
    connection, and a second thread blocking on it could starve this one.
    """

    def __init__(self, handler: RendezvousHandler, events: "queue.SimpleQueue[Any]",
                 generation: int, wait_slice: float,
                 heartbeat: Callable[[], None] | None = None,
                 heartbeat_every: float = HEARTBEAT_EVERY) -> None:
        self._handler = handler
        self._heartbeat = heartbeat
        self._heartbeat_every = heartbeat_every
        self._last_beat = time.monotonic()
        self._events = events
        self._generation = generation
        self._slice = wait_slice
        self._done: tuple[Callable[[], bool], Any] | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"rdzv-membership-{generation}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop reporting; the thread ends after its current wait (at most one slice)."""
        self._stopped.set()

    def also_report(self, condition: Callable[[], bool], event: Any) -> None:
        """Also check ``condition`` between waits and report ``event`` (and end) once it holds."""
        self._done = (condition, event)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                done = self._done
                if done is not None and done[0]():
                    self._events.put(done[1])
                    return
                if self._heartbeat is not None and (
                    time.monotonic() - self._last_beat >= self._heartbeat_every
                ):
                    self._last_beat = time.monotonic()
                    self._heartbeat()
                changed = self._handler.wait_for_membership_change(self._slice)
            except (RendezvousError, OSError) as exc:
                if self._stopped.is_set():
                    return
                logger.warning("cannot watch the rendezvous membership: %s (retrying in %.3g s)",
                               exc, self._slice)
                self._stopped.wait(self._slice)
                continue
            if changed and not self._stopped.is_set():
                self._events.put(MembershipChanged(self._generation))
                return
