"""What a node writes and reads in its round's store to agree on how the round starts (the keys
and encodings are ``_records.py``, the rules ``_decide.py``): its record, the fenced decision
(or a cancel), its assignment; and the plans that carry the decision to its workers."""

from __future__ import annotations

import json
import logging
import os
import time

from .._messages import Plan, PlanKind
from ..errors import RendezvousStateError
from ..rendezvous import (
    AGENT_DECISION,
    AGENT_LEAVING,
    assign_key,
    ready_key,
    record_key,
    restarting_key,
)
from ..store import Store
from ._config import LaunchConfig
from ._decide import DecideContext, decide
from ._protocol import Node, Worker
from ._records import (
    Assignment,
    Decision,
    Kind,
    NodeRecord,
    SlotReport,
    dumps_assignment,
    dumps_decision,
    dumps_record,
    loads_assignment,
    loads_decision,
)

logger = logging.getLogger(__name__)


def build_record(node: Node, config: LaunchConfig, host: str, port: int,
                 leaving: tuple[int, ...], node_id: str | None, joined_s: float,
                 started: float) -> NodeRecord:
    """This node's record now: what each of its workers holds, at which step (extrapolated by
    the decision from ``sampled``), and the group they are in."""
    group, wall, now = node.group, time.time(), time.monotonic()
    api = node.recorded_api(config.restart_on_change)
    running = [s for s in node.slots if s.state is Worker.RUNNING and s.sampled]
    sampled = max((s.sampled for s in running), default=now)
    return NodeRecord(
        slots=tuple(SlotReport(s.report(api), s.step) for s in node.slots),
        role=config.role, host=host, port=port, final=node.record_final,
        inprocess=api,
        restart=node.restart_why, restart_cause=node.restart_cause,
        lineage=group.prefix if group else None, offset=group.offset if group else None,
        group_size=group.size if group else None, held=group.held(node.slots) if group else (),
        leaving=leaving, step_time=max((s.step_time for s in running if s.step_time),
                                       default=None),
        sampled=wall - (now - sampled), node_id=node_id, pid=os.getpid(), time=wall,
        join_s=round(joined_s, 6), max_nodes=config.max_nodes, started=started,
        finished=all(s.state is Worker.DONE for s in node.slots))


def leaving_ranks(store: Store) -> tuple[int, ...]:
    """The global ranks, in the group of the round of ``store``, of the nodes that announced
    their leave there."""
    ranks: set[int] = set()
    for raw in store.list_keys(AGENT_LEAVING).values():
        try:
            ranks.update(int(r) for r in json.loads(raw).get("ranks", []))
        except (ValueError, TypeError, AttributeError):
            logger.warning("ignoring a malformed leave entry: %r", raw[:80])
    return tuple(sorted(ranks))


def write_record(store: Store, node: Node, record: NodeRecord) -> None:
    """The record, and (final) the markers the coordinator counts, in one message."""
    with store.batch():
        store.set(record_key(node.group_rank), dumps_record(record))
        if node.record_final:
            store.set(ready_key(node.group_rank), b"1")
            if record.restart:
                store.set(restarting_key(node.group_rank), b"1")


def write_decision(store: Store, records: dict[int, NodeRecord | None],
                   ctx: DecideContext) -> tuple[Decision, Decision]:
    """Decide and write the round's decision: every assignment under its id, then the decision
    with one fenced write. Returns (this decision, the round's: this one, or the one written
    first)."""
    decision, assignments = decide(records, ctx)
    if assignments:
        ranks = sorted(assignments)
        store.multi_set([assign_key(decision.id, g) for g in ranks],
                        [dumps_assignment(assignments[g]) for g in ranks])
    current = store.compare_set(AGENT_DECISION, b"", dumps_decision(decision).encode())
    return decision, loads_decision(AGENT_DECISION, current)


def write_cancel(store: Store, by: str, group_rank: int) -> Decision:
    """Cancel the round (a participant was lost before its decision), fenced: the round's
    decision after it, the cancel or a decision written first."""
    cancel = Decision(Kind.CANCEL, os.urandom(6).hex(), by=by,
                      why=f"cancelled by group rank {group_rank}")
    return loads_decision(AGENT_DECISION, store.compare_set(AGENT_DECISION, b"",
                                                          dumps_decision(cancel).encode()))


def read_assignment(store: Store, decision: Decision, group_rank: int) -> Assignment:
    """This node's assignment, which is written before the decision that names it."""
    key = assign_key(decision.id, group_rank)
    raw = store.try_get(key)
    if raw is None:
        raise RendezvousStateError(f"the decision names an assignment {key!r} that is not in "
                                   "the round's store")
    return loads_assignment(key, raw)


def plans(gen: int, decision: Decision, mine: Assignment) -> list[tuple[int, Plan]]:
    """Each of this node's workers in the new group (by local rank), and its plan."""
    kind = PlanKind(decision.kind.value)
    return [(lr, Plan(round=gen, kind=kind, step=decision.step, source=decision.source,
                      rank=mine.rank_offset + i, world_size=mine.world_size,
                      group_rank=mine.group_rank, group_world_size=mine.group_world_size,
                      role_rank=mine.role_rank_offset + i, role_world_size=mine.role_world_size,
                      master_addr=mine.master_addr, master_port=mine.master_port,
                      prefix=decision.prefix))
            for i, lr in enumerate(mine.local_ranks)]
