"""How a round starts, decided once by its group rank 0 from every node's record: pure functions.

:func:`decide` reads the records (``_records.py``) and returns the round's one decision and every
node's assignment. In order:

1. A node that wrote no record by the deadline: ``cancel`` (it is gone or hung; the rendezvous
   forms the next round without it, or with it once it is back).
2. A node that needs its workers restarted (a worker failed outside the in-process API, or
   ``--restart-on-change``, or workers that never connected to their agent): ``restart``
   (the workers of a node that finished too: one failure restarts the job, as torch's does).
3. A node whose workers finished the job, and no worker that holds a training state (a node
   that came as the job ended): ``finish``; nobody starts anything, every node ends.
4. No worker runs anywhere: ``start``.
5. No worker holds the training state (every holder crashed): ``recover`` from nobody; the
   workers start from their checkpoint, in-process.
6. A holder's group failed (``broken``), lost a member (one of its ranks is neither held by a
   node of the round nor announced as leaving: a node died or hung while the round formed), or
   holders come from different groups: ``recover``:
   every worker adopts the state of the holder with the most completed steps (the lowest global
   rank among equals), so a step that completed on some is kept and nobody goes on with
   parameters another lacks.
7. Every holder runs in one group: ``stay`` if the round's group is that group (same workers,
   same ranks), else ``switch`` at a step far enough ahead that every worker hears of it first.

The global ranks follow the group ranks; each node contributes its slots that are not absent
(all of them for ``start`` and ``restart``). The new group's store is served by its global rank
0, on the port its node reserved in its record. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ._records import Assignment, Decision, Kind, NodeRecord, SlotState

LEAD_SECONDS = 0.25
"""How long the switch step is announced ahead of time, at least (see :func:`switch_step`)."""


@dataclass(frozen=True)
class DecideContext:
    decision_id: str
    """A new unique id: it names the assignments and the new group's store prefix."""
    by: str
    """The deciding node's id."""
    now: float
    """The wall time (records' steps are extrapolated to it)."""
    nodes: int
    """The round's number of nodes."""
    timed_out: bool = False
    """The wait for the records ended at its deadline (``timeout_s`` seconds)."""
    timeout_s: float = 0.0


def switch_step(step: int, step_time: float | None, lead_seconds: float, min_lead: int = 2,
                max_lead: int = 10_000) -> int:
    """The step boundary at which the old group switches, given its workers at ``step`` with
    steps of ``step_time`` seconds (None: not measured yet).

    Far enough ahead that every worker hears of it before it gets there: the message takes up
    to ``lead_seconds`` to reach them all, and data-parallel workers may be one step apart. A
    worker already past it moves at its next step boundary, and the group's agreement on
    entering brings every worker to the most advanced state.
    """
    if step_time is None or step_time <= 0:
        lead = min_lead
    else:
        lead = min_lead + math.ceil(lead_seconds / step_time)
    return step + max(min_lead, min(lead, max_lead))


def plan_assignments(nodes: list[tuple[int, str]]) -> list[dict[str, int]]:
    """Offsets of each node (given as (workers, role) in group-rank order): global and per role."""
    world_size = sum(count for count, _ in nodes)
    role_sizes: dict[str, int] = {}
    for count, role in nodes:
        role_sizes[role] = role_sizes.get(role, 0) + count
    offset, role_offsets = 0, dict.fromkeys(role_sizes, 0)
    plans: list[dict[str, int]] = []
    for count, role in nodes:
        plans.append({"offset": offset, "world": world_size, "role_offset": role_offsets[role],
                      "role_world": role_sizes[role]})
        offset += count
        role_offsets[role] += count
    return plans


def _assign(records: Mapping[int, NodeRecord], everyone: bool) -> tuple[dict[int, Assignment],
                                                                        tuple[str, int]]:
    """Each node's assignment (all its slots if ``everyone``, else those not absent), and the
    new group's store address (the node of global rank 0)."""
    order = sorted(records)
    local = {g: list(range(len(records[g].slots))) if everyone else records[g].present
             for g in order}
    plans = plan_assignments([(len(local[g]), records[g].role) for g in order])
    first = next((g for g in order if local[g]), order[0])
    master = (records[first].host, records[first].port)
    return {g: Assignment(group_rank=g, group_world_size=len(order),
                          rank_offset=plan["offset"], world_size=plan["world"],
                          role_rank_offset=plan["role_offset"],
                          role_world_size=plan["role_world"], master_addr=master[0],
                          master_port=master[1], local_ranks=tuple(local[g]))
            for g, plan in zip(order, plans)}, master


def _holders(records: Mapping[int, NodeRecord],
             assignments: Mapping[int, Assignment]) -> dict[int, tuple[int, NodeRecord]]:
    """Global rank (new group) -> (completed steps, its node's record) of every worker that
    holds the training state."""
    found = {}
    for g, record in records.items():
        for lr in assignments[g].local_ranks:
            slot = record.slots[lr]
            if slot.state.holds_state:
                found[assignments[g].global_rank(lr)] = (slot.step or 0, record)
    return found


def _estimated_step(records: Mapping[int, NodeRecord], now: float) -> tuple[int, float | None]:
    """The running workers' step now, extrapolated from each record's sample, and the step time."""
    best, step_time = 0, None
    for record in records.values():
        steps = [s.step or 0 for s in record.slots if s.state is SlotState.RUNNING]
        if not steps:
            continue
        elapsed = 0.0
        if record.step_time and record.step_time > 0:
            elapsed = max(0.0, now - record.sampled) / record.step_time
            step_time = max(step_time or 0.0, record.step_time)
        best = max(best, max(steps) + math.ceil(elapsed))
    return best, step_time


def decide(records: Mapping[int, NodeRecord | None], ctx: DecideContext
           ) -> tuple[Decision, dict[int, Assignment]]:
    """The round's decision and every node's assignment (see the module's docstring)."""
    base: dict[str, Any] = {"id": ctx.decision_id, "by": ctx.by, "nodes": ctx.nodes}
    missing = sorted(g for g in range(ctx.nodes) if records.get(g) is None)
    if missing:
        return Decision(Kind.CANCEL, why=f"node(s) of group rank {_ranks(missing)} wrote no "
                        f"record within {ctx.timeout_s:g} s", **base), {}
    full: dict[int, NodeRecord] = {g: r for g, r in records.items() if r is not None}
    unsettled = sorted(g for g, r in full.items() if not r.final)
    restart = next(((r.restart_cause or "worker_failed", f"node {g}: {r.restart}")
                    for g, r in sorted(full.items()) if r.restart), None)
    if restart is None and unsettled:
        restart = ("connect_timeout", f"the workers of group rank {_ranks(unsettled)} did not "
                   f"connect to their agent within {ctx.timeout_s:g} s (do they use "
                   "rdzv.torch.ElasticState?)")
    finished = sorted(g for g, r in full.items() if r.finished)
    if restart is None and finished and not any(
            s.state.holds_state for r in full.values() for s in r.slots):
        return Decision(Kind.FINISH, why=f"the workers of group rank {_ranks(finished)} "
                        "finished the job", **base), {}
    live = any(s.state is not SlotState.ABSENT for r in full.values() for s in r.slots)
    if restart is None and live:
        restart = next((("not_inprocess", f"node {g}'s workers do not switch in-process")
                        for g, r in sorted(full.items()) if r.inprocess is False and any(
                            s.state is not SlotState.ABSENT for s in r.slots)), None)
    if restart is not None or not live:
        assignments, master = _assign(full, everyone=True)
        cause, why = restart or ("", "")
        return Decision(Kind.RESTART if restart else Kind.START, why=why, cause=cause,
                        prefix=f"rdzv-{ctx.decision_id}", master_addr=master[0],
                        master_port=master[1],
                        world_size=sum(len(r.slots) for r in full.values()), **base), assignments
    assignments, master = _assign(full, everyone=False)
    world_size = sum(len(a.local_ranks) for a in assignments.values())
    holders = _holders(full, assignments)
    receivers = world_size - len(holders)  # the fresh workers
    new_group: dict[str, Any] = {"prefix": f"rdzv-{ctx.decision_id}", "master_addr": master[0],
                 "master_port": master[1], "world_size": world_size}
    if not holders:
        return Decision(Kind.RECOVER, why="no worker holds the training state: the workers "
                        "start from their checkpoint", receivers=world_size, **new_group,
                        **base), assignments
    lineages = {record.lineage for _, record in holders.values()}
    broken = any(s.state is SlotState.BROKEN for r in full.values() for s in r.slots)
    if broken or len(lineages) > 1 or _lost_members(full):
        top = max(step for step, _ in holders.values())
        source = min(rank for rank, (step, _) in holders.items() if step == top)
        behind = sum(1 for step, _ in holders.values() if step < top)
        why = ("a worker's group failed" if broken else
               "the workers come from different groups" if len(lineages) > 1 else
               "a member of the workers' group was lost while the round formed")
        return Decision(Kind.RECOVER, why=why, step=top, source=source,
                        receivers=receivers + behind, **new_group, **base), assignments
    lineage = lineages.pop()
    same = receivers == 0 and all(
        record.lineage == lineage and record.offset == assignments[g].rank_offset
        and record.group_size == world_size
        for g, record in full.items() if assignments[g].local_ranks)
    if same:
        return Decision(Kind.STAY, why="the round's group is the running one",
                        prefix=lineage or "", master_addr=master[0], master_port=master[1],
                        world_size=world_size, **base), assignments
    step, step_time = _estimated_step(full, ctx.now)
    return Decision(Kind.SWITCH, step=switch_step(step, step_time, LEAD_SECONDS),
                    source=min(holders), receivers=receivers, **new_group, **base), assignments


def _lost_members(records: Mapping[int, NodeRecord]) -> bool:
    """Whether a group the holders come from has a rank that no node of the round holds and
    no node saw announced as leaving."""
    by_group: dict[str, tuple[int, set[int]]] = {}
    for record in records.values():
        if record.lineage is None or record.group_size is None or not record.held:
            continue
        size, seen = by_group.setdefault(record.lineage, (record.group_size, set()))
        seen.update(record.held, record.leaving)
    return any(set(range(size)) - seen for size, seen in by_group.values())


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)
