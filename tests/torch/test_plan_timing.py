"""When a worker acts on its agent's plan (``rdzv.torch._elastic.due``), a table: a recovery at
once; a leave from its step on; a switch from its step on, and in a node that shards the model
only once every worker of the node held that plan at the step's commit, so that the node's
workers move at one step boundary (a worker that heard of the plan late would otherwise wait in
the next step, in the node's group, for a local peer that moved, until the switch's timeout)."""

from __future__ import annotations

import pytest

from rdzv._messages import Plan, PlanKind
from rdzv.torch._elastic import due

SWITCH = Plan(round=7, kind=PlanKind.SWITCH, step=100)
LEAVE = Plan(round=7, kind=PlanKind.LEAVE, step=100)
RECOVER = Plan(round=7, kind=PlanKind.RECOVER, step=90)
NONE_HELD = -1
"""What the commit says when not every worker of the node held one plan."""


@pytest.mark.parametrize(("plan", "step", "agreed", "moves"), [
    # a recovery: at once, wherever the worker is and whatever its node held
    (RECOVER, 50, None, True),
    (RECOVER, 50, NONE_HELD, True),
    # no commit in the step (a replicated model, a step without the optimizer's): the step rules
    (SWITCH, 99, None, False),
    (SWITCH, 100, None, True),
    (SWITCH, 103, None, True),  # heard of it late: moves at its next boundary
    (Plan(round=7, kind=PlanKind.SWITCH), 5, None, True),  # no step: at once
    # a node that shards the model: only what every worker of it held at the commit
    (SWITCH, 100, 7, True),
    (SWITCH, 99, 7, False),  # held by all, but not due yet
    (SWITCH, 100, NONE_HELD, False),  # a local peer had not heard of it: the node goes on
    (SWITCH, 103, NONE_HELD, False),
    (SWITCH, 100, 6, False),  # they all held an older plan, which this one replaced since
    # a leave: the step rule alone (a local peer that goes on is freed when the leaver ends;
    # held back, the node's failed step would make its agent stop it instead of a clean leave)
    (LEAVE, 100, None, True),
    (LEAVE, 100, NONE_HELD, True),
    (LEAVE, 99, None, False),
])
def test_when_a_worker_acts_on_its_plan(plan: Plan, step: int, agreed: int | None,
                                        moves: bool) -> None:
    assert due(plan, step, agreed) is moves
