"""The chaos soak's invariants on hand-made histories: one good, and one for each way to fail."""

from __future__ import annotations

from typing import Any

import pytest
from chaos_checks import Event, Limits, check_all, figures, recoveries, settled

LIMITS = Limits(min_nodes=2, max_nodes=3, recovery_bound=10.0, hold=2.0)


def ev(t: float, name: str, **fields: Any) -> Event:
    return {"t": t, "ev": name, **fields}


def round_of(t: float, r: int, names: list[str], world: int | None = None) -> list[Event]:
    """Every node in ``names`` joins round r with rank = its index and reads the set back."""
    world = world or len(names)
    return ([ev(t, "joined", node=n, round=r, rank=i, world=world, node_id=f"{n}#{r}")
             for i, n in enumerate(names)]
            + [ev(t + 0.01, "members", node=n, round=r, members=names, conflict=None)
               for n in names])


START = [ev(0.0, "start", node=n) for n in ("a", "b", "c")]
END = [ev(20.0, "faults_end"), ev(30.0, "end", alive=["a", "b", "c"]),
       ev(30.0, "ack_check", acked=100, missing=0)]
GOOD = (START + round_of(1.0, 0, ["a", "b", "c"]) + [ev(5.0, "fault", kind="kill", target="c"),
        ev(5.5, "start", node="d")] + round_of(6.0, 1, ["a", "b", "d"])
        + [ev(7.0, "step", node="a", round=1, waiting=0)]
        + [ev(30.0, "end", alive=["a", "b", "d"]), ev(20.0, "faults_end")])

TWO_WORLDS = (START + [ev(1.0, "joined", node="a", round=0, rank=0, world=2, node_id="a#0"),
                       ev(1.0, "joined", node="b", round=0, rank=1, world=3, node_id="b#0")]
              + round_of(2.0, 1, ["a", "b", "c"]) + END)
STALE_IN_STORE = (START + round_of(1.0, 0, ["a", "b"]) + round_of(3.0, 1, ["a", "b", "c"])
                  + [ev(2.0, "seal_pause", node="c", round=0, listed=3, node_id="c-old"),
                     ev(25.0, "decision", round=0, status={"world_size": 2},
                        ranks={"c-old": {"rank": 1, "world_size": 2}})] + END)
LIVELOCK = START + [e for r in range(40) for e in round_of(1.0 + r * 0.5, r, ["a", "b", "c"])] \
    + END
NO_COMMON_ROUND = (START + round_of(1.0, 0, ["a", "b"])
                   + [ev(2.0, "waiting", node="c", node_id="c#1")] + END)
SPARE_BESIDE_SMALL = (START + [ev(0.5, "start", node="d")] + round_of(1.0, 0, ["a", "b"])
                      + [ev(2.0, "spare", node="c", node_id="c#1"), ev(20.0, "faults_end"),
                         ev(30.0, "end", alive=["a", "b", "c"])])
SPARE_BESIDE_FULL = (START + [ev(0.5, "start", node="d")] + round_of(1.0, 0, ["a", "b", "c"])
                     + [ev(2.0, "spare", node="d", node_id="d#1"), ev(20.0, "faults_end"),
                        ev(30.0, "end", alive=["a", "b", "c", "d"])])
UNEXPECTED = GOOD + [ev(5.2, "error", node="a", type="KeyError", expected=False, message="x")]
LOST_WRITE = GOOD + [ev(9.0, "ack_check", acked=50, missing=1)]
STRANGER = (START + round_of(1.0, 0, ["a", "b"])
            + [ev(1.1, "members", node="c", round=0, members=["a", "c"], conflict="b"),
               ev(20.0, "faults_end"), ev(30.0, "end", alive=["a", "b"])])


@pytest.mark.parametrize("history, found", [
    (GOOD, []),
    (SPARE_BESIDE_FULL, []),
    (TWO_WORLDS, ["one-decision"]),
    (STALE_IN_STORE, ["one-decision"]),
    (LIVELOCK, ["livelock"]),
    (NO_COMMON_ROUND, ["liveness"]),
    (SPARE_BESIDE_SMALL, ["liveness"]),
    (UNEXPECTED, ["exception"]),
    (LOST_WRITE, ["acked-data"]),
    (STRANGER, ["one-decision", "two-groups"]),
], ids=["good", "spare-beside-full", "two-worlds", "stale-decision-in-store", "livelock",
        "no-common-round", "spare-beside-small", "unexpected-exception", "lost-write",
        "stranger-in-member-set"])
def test_invariants(history: list[Event], found: list[str]) -> None:
    violations = check_all(history, LIMITS)
    assert sorted({v.check for v in violations}) == found, [v.describe() for v in violations]


def test_the_final_round_must_hold() -> None:
    late = GOOD[:-2] + round_of(29.5, 2, ["a", "b", "d"]) + GOOD[-2:]
    assert [v.check for v in check_all(late, LIMITS)] == ["livelock"]


def test_a_two_decision_round_is_named_with_its_events() -> None:
    (violation,) = check_all(STALE_IN_STORE, LIMITS)
    assert violation.round == 0
    assert "c (c-old) rank 1 of 2" in violation.describe()
    assert "seal_pause" in violation.describe()


def test_settled_counts_spares() -> None:
    state = settled(SPARE_BESIDE_FULL, ["a", "b", "c", "d"], LIMITS)
    assert (state.round, state.members, state.spares, state.problem) == (
        0, ("a", "b", "c"), ("d",), "")


def test_figures() -> None:
    numbers = figures(GOOD + [ev(8.0, "error", node="a", type="SessionExpiredError",
                                 expected=True, message="")])
    assert numbers["rounds"] == 2
    assert numbers["faults"] == {"kill": 1}
    assert numbers["expected exceptions"] == {"SessionExpiredError": 1}


def test_what_happens_after_the_end_is_not_part_of_the_run() -> None:
    stopping = GOOD + round_of(31.0, 2, ["a", "b"])  # the harness kills d first
    assert check_all(stopping, LIMITS) == []


def test_one_seed_gives_one_schedule_with_every_kind_first() -> None:
    from chaos_harness import KINDS, plan

    schedule = plan(17, 60.0, (1.0, 3.0))
    assert schedule == plan(17, 60.0, (1.0, 3.0)) != plan(18, 60.0, (1.0, 3.0))
    assert sorted(kind for _, kind in schedule[:len(KINDS)]) == sorted(KINDS)
    assert all(0 < t < 60.0 for t, _ in schedule)


def test_recovery_after_a_server_restart_leaves_out_nodes_hit_meanwhile() -> None:
    history = [ev(9.5, "step", node=n, round=0, waiting=0) for n in ("a", "b")] + [
        ev(10.0, "fault", kind="server", target="rdzv serve"), ev(12.0, "server_up"),
        ev(12.5, "fault", kind="pause", target="b"), ev(13.0, "step", node="a", round=0),
        ev(30.0, "joined", node="b", round=1, rank=0, world=2, node_id="b#1")]
    assert recoveries(history) == [3.0]
