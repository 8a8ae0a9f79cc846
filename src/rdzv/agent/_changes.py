"""The rules of a planned membership change, as pure functions of what the agent observed.

A change of a running round is *planned* when every member is still alive: a node waits to join,
or a member announced that it leaves. The agents then form the next round in the background
while the workers train, and switch to it when it is sealed: in-process when every node's
workers use the in-process API, else by restarting the workers in the new round. A change in
which a member is gone (died, hung past its heartbeat) is a *loss*: the group stops and
re-forms as before. Nothing here does I/O or reads a clock (see ``_transition.py``).
"""

from __future__ import annotations

import enum
import math


class Change(enum.Enum):
    PLANNED = "planned"
    """Every member is alive: form the next round in the background, keep training."""
    LOST = "lost"
    """A member is gone (or the change cannot be explained): stop and re-form now."""


class Mode(enum.Enum):
    IN_PROCESS = "in-process"
    """The running workers switch to the new round inside their processes."""
    RESTART = "restart"
    """The workers are stopped and started anew in the new round."""


def classify_change(world_size: int, alive: int, leaving: int, waiting: int) -> Change:
    """A membership change of a round of ``world_size`` nodes, of which ``alive`` still mark
    themselves alive, ``leaving`` announced that they leave and ``waiting`` nodes (newcomers or
    members already moving on) wait in the next round."""
    if alive < world_size:
        return Change.LOST
    if leaving > 0 or waiting > 0:
        return Change.PLANNED
    return Change.LOST


def choose_mode(restart_on_change: bool, coordinator_was_member: bool, capable_nodes: int,
                old_world_size: int) -> Mode:
    """How the nodes of a new round switch to it, decided once by its group rank 0.

    In-process needs the workers of every node of the old round to use the API (newcomers run
    the same program) and a coordinator that knows the old group's progress (a member of it).
    """
    if restart_on_change or not coordinator_was_member:
        return Mode.RESTART
    return Mode.IN_PROCESS if capable_nodes >= old_world_size else Mode.RESTART


def switch_step(step: int, step_time: float | None, lead_seconds: float, min_lead: int = 2,
                max_lead: int = 10_000) -> int:
    """The step boundary at which the old group switches, given the coordinator's worker at
    ``step`` with steps of ``step_time`` seconds (None: not measured yet).

    Far enough ahead that every worker of the old group hears of it before it gets there: the
    message takes up to ``lead_seconds`` to reach them all, and data-parallel workers may be one
    step apart (each step synchronises them). A worker that is past it anyway reports a miss and
    the agents fall back to a restart.
    """
    if step_time is None or step_time <= 0:
        lead = min_lead
    else:
        lead = min_lead + math.ceil(lead_seconds / step_time)
    return step + max(min_lead, min(lead, max_lead))


def recovery_plan(steps: dict[int, int], newcomers: list[int]) -> tuple[int, int, list[int]]:
    """After a member was lost: (source, step, receivers). ``steps`` maps each surviving worker's
    global rank in the new group to the steps it completed (survivors may be one apart: a step
    whose collectives completed on some before the failure). Everyone adopts the state of the
    most advanced survivor (the lowest such rank): a complete step is kept, never undone, and
    no survivor goes on with parameters another lacks. The others and the newcomers receive it.
    """
    top = max(steps.values())
    source = min(rank for rank, step in steps.items() if step == top)
    behind = [rank for rank, step in steps.items() if step < top]
    return source, top, sorted(behind + newcomers)
