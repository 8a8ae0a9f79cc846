"""The agent's part of the run's history: what its workers did, what a change cost, and why
a lost member was lost. Events go through the rendezvous handler's background writer
(``record_event``); a handler without one (static, a plug-in) records nothing."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping

from ..errors import RendezvousError
from ..rendezvous import (
    AGENT_ALIVE,
    AGENT_NODES,
    AGENT_SEEN,
    RendezvousHandler,
    RendezvousInfo,
    why_lost,
)
from ._errors import WorkerFailure, signal_name
from ._round import HEARTBEAT_EVERY

logger = logging.getLogger(__name__)

MAX_FAILURES = 8
"""Worker failures recorded per restart (the first ones; a node may run many workers)."""


def record(handler: RendezvousHandler, kind: str, **fields: Any) -> None:
    """Record an event of this node (never raises; nothing if the handler keeps no history)."""
    record_event = getattr(handler, "record_event", None)
    if record_event is not None:
        record_event(kind, **fields)


def failure_fields(failure: WorkerFailure) -> dict[str, Any]:
    """A worker failure's fields: global rank, local rank, exit code or signal, and the first
    line of the error the worker recorded (if any)."""
    fields: dict[str, Any] = {"rank": failure.global_rank, "local_rank": failure.local_rank,
                              "pid": failure.pid}
    if failure.exit_code < 0:
        fields["signal"] = signal_name(-failure.exit_code)
    else:
        fields["exit_code"] = failure.exit_code
    if failure.error is not None and failure.error.message:
        fields["error"] = failure.error.message.strip().splitlines()[0][:200]
    return fields


def heartbeat_every(ttl: float) -> float:
    """Seconds between an agent's signs of life: at least three per session ttl, so that the
    silence of a lost member tells how it was lost (:func:`why_lost`)."""
    return min(HEARTBEAT_EVERY, ttl / 3)


def lost_members(world_size: int, alive: Mapping[int, Any], seen: Mapping[int, float],
                 nodes: Mapping[int, str | None], now: float, ttl: float
                 ) -> dict[int, tuple[str | None, str, float | None]]:
    """The ranks of a round of ``world_size`` whose alive entry is gone: rank -> (node id,
    why it was lost, seconds it had been silent), from the lasting ``seen`` stamps."""
    lost = {}
    for rank in range(world_size):
        if rank in alive:
            continue
        silent = now - seen[rank] if rank in seen else None
        lost[rank] = (nodes.get(rank), why_lost(silent, heartbeat_every(ttl), ttl),
                      None if silent is None else round(silent, 3))
    return lost


def _ranked(listed: Mapping[str, bytes], prefix: str) -> dict[int, Any]:
    out = {}
    for key, raw in listed.items():
        try:
            out[int(key[len(prefix):] if key.startswith(prefix) else key.rsplit("/", 1)[1])] = \
                json.loads(raw)
        except (ValueError, IndexError):
            continue
    return out


def report_losses(handler: RendezvousHandler, info: RendezvousInfo, ttl: float) -> None:
    """A member of this node's round was lost: the lowest surviving group rank says who and
    why (``node_lost`` events, and marks the next round's ``round_formed`` reads). One read and
    one write, on the loss path only; a store error is logged."""
    store = info.store
    try:
        reads = store.read_many(lists=[AGENT_ALIVE, AGENT_SEEN, AGENT_NODES])
    except RendezvousError as exc:
        logger.warning("cannot tell which member was lost: %s", exc)
        return
    alive = _ranked(reads.lists[AGENT_ALIVE], AGENT_ALIVE)
    if info.rank in alive and info.rank != min(alive):
        return  # one report is enough: the lowest living rank's
    seen = {rank: entry["time"] for rank, entry in _ranked(reads.lists[AGENT_SEEN], AGENT_SEEN).items()
            if isinstance(entry, dict) and isinstance(entry.get("time"), (int, float))}
    nodes = {rank: entry.get("node_id") for rank, entry
             in _ranked(reads.lists[AGENT_NODES], AGENT_NODES).items() if isinstance(entry, dict)}
    lost = lost_members(info.world_size, alive, seen, nodes, time.time(), ttl)
    marks = {node: reason for node, reason, _ in lost.values() if isinstance(node, str)}
    report_left = getattr(handler, "report_left", None)
    if report_left is not None:
        report_left(marks)
    for rank, (node, reason, silent) in sorted(lost.items()):
        record(handler, "node_lost", lost=node, rank=rank, reason=reason, silent_s=silent)
