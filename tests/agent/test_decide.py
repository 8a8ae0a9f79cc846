"""How a round starts, as tables (``rdzv/agent/_decide.py``), and its records' encoding."""

from __future__ import annotations

import json

import pytest

from rdzv.agent._decide import DecideContext, decide, plan_assignments, switch_step
from rdzv.agent._records import (
    Decision,
    Kind,
    NodeRecord,
    SlotReport,
    SlotState,
    dumps_decision,
    dumps_record,
    loads_decision,
    loads_record,
)
from rdzv.errors import RendezvousStateError

R, B, F, S, A = (SlotState.RUNNING, SlotState.BROKEN, SlotState.FRESH, SlotState.STARTING,
                 SlotState.ABSENT)
NOW = 1_800_000_000.0


def record(*slots: tuple[SlotState, int | None], lineage: str | None = "g1",
           offset: int | None = 0, size: int | None = 3, final: bool = True,
           inprocess: bool | None = True, restart: str | None = None, host: str = "h",
           step_time: float | None = 0.05, sampled: float = NOW,
           leaving: tuple[int, ...] = (), finished: bool = False) -> NodeRecord:
    """A node's record; its workers that hold a state hold ranks ``offset``.. of the group."""
    held = tuple(offset + i for i, (state, _) in enumerate(slots) if state.holds_state) \
        if offset is not None and lineage is not None else ()
    return NodeRecord(slots=tuple(SlotReport(state, step) for state, step in slots),
                      role="default", host=host, port=7000, final=final, inprocess=inprocess,
                      restart=restart, lineage=lineage, offset=offset, group_size=size,
                      held=held, leaving=leaving, step_time=step_time, sampled=sampled,
                      finished=finished)


def ctx(nodes: int, timed_out: bool = False) -> DecideContext:
    return DecideContext("d1", "node0", NOW, nodes, timed_out, 60.0)


def group_of_three(*steps: int, state: SlotState = R) -> dict[int, NodeRecord | None]:
    return {g: record((state, step), offset=g) for g, step in enumerate(steps)}


ROWS = [
    ("the first round: no worker runs", {0: record((A, None), lineage=None, offset=None,
                                               size=None), 1: record((A, None), lineage=None)},
     Kind.START, None, None),
    ("nothing changed: the running group is the round's",
     group_of_three(40, 40, 40), Kind.STAY, None, None),
    ("a newcomer: the others switch ahead of their step, rank 0 sends",
     {0: record((R, 40), offset=0, size=2), 1: record((R, 40), offset=1, size=2),
      2: record((F, None), lineage=None, offset=None, size=None)},
     Kind.SWITCH, 40 + 2 + 5, 0),
    ("a member left: a smaller group, switched at a step ahead",
     {0: record((R, 40), offset=0, leaving=(1,)), 1: record((R, 41), offset=2)}, Kind.SWITCH,
     41 + 2 + 5, 0),
    ("a member lost while the round formed (no word, no worker of it here): recover",
     {0: record((R, 40), offset=0), 1: record((R, 41), offset=2)}, Kind.RECOVER, 41, 1),
    ("a member lost: recover from the most advanced survivor (lowest rank among equals)",
     {0: record((B, 40), offset=0), 1: record((B, 41), offset=1), 2: record((B, 41),
                                                                         offset=2)},
     Kind.RECOVER, 41, 1),
    ("a loss beside a join: recover, the newcomer receives",
     {0: record((B, 40), offset=0), 1: record((F, None), lineage=None)}, Kind.RECOVER, 40, 0),
    ("holders from different groups: recover (a node that missed a round)",
     {0: record((R, 40), offset=0, size=1), 1: record((R, 40), lineage="g0", offset=0,
                                                      size=1)},
     Kind.RECOVER, 40, 0),
    ("a worker crash on group rank 0 (global rank 0): the others recover without it",
     {0: record((A, None), offset=0), 1: record((B, 40), offset=1), 2: record((B, 40),
                                                                           offset=2)},
     Kind.RECOVER, 40, 0),
    ("every holder crashed: the fresh workers start from their checkpoint, in-process",
     {0: record((F, None)), 1: record((F, None), offset=1)}, Kind.RECOVER, None, None),
    ("a leaver and a loss together: the loss wins, recover",
     {0: record((R, 40), offset=0, size=4, leaving=(1,)), 1: record((R, 40), offset=2, size=4)},
     Kind.RECOVER, 40, 0),
    ("a worker failed outside the API: the restart fallback",
     {**group_of_three(40, 40, 40), 1: record((B, 40), restart="rank 1: exit code 1")},
     Kind.RESTART, None, None),
    ("a node's workers do not use the API: restart",
     {**group_of_three(40, 40), 2: record((R, None), inprocess=False)}, Kind.RESTART, None,
     None),
    ("workers that did not connect by the deadline: restart",
     {0: record((R, 40)), 1: record((S, None), final=False, inprocess=None)},
     Kind.RESTART, None, None),
    ("a node came as the job ended (the others' workers finished it): finish",
     {0: record((A, None), finished=True), 1: record((A, None), offset=1, finished=True),
      2: record((F, None), lineage=None)}, Kind.FINISH, None, None),
    ("... also before its workers started (nobody runs: not a start)",
     {0: record((A, None), finished=True), 1: record((A, None), lineage=None)}, Kind.FINISH,
     None, None),
    ("a node finished while another's worker failed outside the API: restart, as before",
     {0: record((A, None), finished=True), 1: record((A, None), offset=1,
                                                     restart="rank 1: exit code 1")},
     Kind.RESTART, None, None),
    ("a node finished while another still trains: not the end (recover)",
     {0: record((A, None), size=2, finished=True), 1: record((R, 40), offset=1, size=2)},
     Kind.RECOVER, 40, 0),
    ("a node wrote nothing by the deadline (dead or hung): cancel",
     {0: record((R, 40)), 1: None}, Kind.CANCEL, None, None),
]


@pytest.mark.parametrize(("records", "kind", "step", "source"), [row[1:] for row in ROWS],
                         ids=[row[0] for row in ROWS])
def test_decide(records: dict[int, NodeRecord | None], kind: Kind, step: int | None,
                source: int | None) -> None:
    decision, _ = decide(records, ctx(len(records), timed_out=None in records.values()))
    assert (decision.kind, decision.step, decision.source) == (kind, step, source)


def test_absent_workers_take_no_rank_and_the_store_goes_where_global_rank_0_is() -> None:
    records = {0: record((A, None), host="n0"), 1: record((B, 40), (B, 40), host="n1"),
               2: record((F, None), host="n2")}
    decision, assignments = decide(records, ctx(3))
    assert decision.world_size == 3 and decision.master_addr == "n1"
    assert [(a.rank_offset, a.local_ranks) for _, a in sorted(assignments.items())] == [
        (0, ()), (0, (0, 1)), (2, (0,))]
    assert assignments[1].global_rank(1) == 1 and decision.receivers == 1


def test_a_restart_restarts_every_worker_of_every_node() -> None:
    records = {0: record((A, None), (R, 3), restart="crash"), 1: record((R, 3), (R, 3))}
    decision, assignments = decide(records, ctx(2))
    assert decision.kind is Kind.RESTART and decision.world_size == 4
    assert [a.local_ranks for _, a in sorted(assignments.items())] == [(0, 1), (0, 1)]


def test_the_switch_step_follows_the_workers_to_now() -> None:
    records = {0: record((R, 40), sampled=NOW - 1.0, size=1),
               1: record((F, None), lineage=None)}
    decision, _ = decide(records, ctx(2))
    assert decision.step == 40 + 20 + 2 + 5  # one second at 50 ms a step, then the lead


@pytest.mark.parametrize(
    ("step", "step_time", "lead_seconds", "expected"),
    [
        (100, 0.064, 0.25, 100 + 2 + 4),   # 0.25 s is 4 steps of 64 ms
        (100, 1.0, 0.25, 103),             # long steps: two steps ahead, and one to hear of it
        (0, None, 0.25, 2),                # not measured yet
        (7, 0.0, 0.25, 9),
        (10, 1e-6, 0.25, 10 + 10_000),     # tiny steps: capped
    ],
)
def test_switch_step(step: int, step_time: float | None, lead_seconds: float,
                     expected: int) -> None:
    assert switch_step(step, step_time, lead_seconds) == expected


def test_offsets_are_prefix_sums_also_per_role() -> None:
    plans = plan_assignments([(2, "trainer"), (4, "trainer"), (1, "evaluator"), (3, "trainer")])
    assert [p["offset"] for p in plans] == [0, 2, 6, 7]
    assert {p["world"] for p in plans} == {10}
    assert [p["role_offset"] for p in plans] == [0, 2, 0, 6]
    assert [p["role_world"] for p in plans] == [9, 9, 1, 9]


def test_records_and_decisions_survive_their_encoding() -> None:
    mine = record((R, 40), (F, None))
    assert loads_record("k", dumps_record(mine).encode()) == mine
    done = record((A, None), finished=True)
    assert loads_record("k", dumps_record(done).encode()) == done
    assert json.loads(dumps_record(mine))["nproc"] == 2  # what `rdzv status` shows
    decision = Decision(Kind.SWITCH, "d9", by="n", step=7, source=0, prefix="rdzv-d9")
    assert loads_decision("k", dumps_decision(decision).encode()) == decision


@pytest.mark.parametrize("raw", [
    b"garbage", b"[]", b'{"v":1,"t":"decision","kind":"reboot","id":"x"}',
    b'{"v":9,"t":"decision","kind":"switch"}', b'{"v":1,"t":"record","slots":[["x",1]]}',
    b'{"v":1,"t":"decision","kind":"switch","id":"x","by":"","why":"","step":"7"}',
])
def test_a_malformed_agent_key_is_an_error_naming_it(raw: bytes) -> None:
    with pytest.raises(RendezvousStateError, match="agent key 'agent/ctl/decision'"):
        (loads_record if b'"record"' in raw else loads_decision)("agent/ctl/decision", raw)
