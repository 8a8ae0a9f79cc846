"""The pure rendezvous rules as tables: observed state + clock -> action (no store, no sleeping)."""

from __future__ import annotations

import pytest

from rdzv.rendezvous._decisions import (
    Action,
    RoundRules,
    RoundView,
    Verdict,
    check_rank,
    decide,
    is_spare,
    join_deadline,
    membership_changed,
    members_lost,
    nodes_waiting,
    plan_ranks,
)
from rdzv.rendezvous._layout import Decision, NodeDescriptor

RULES = RoundRules(min_nodes=2, max_nodes=4, last_call_timeout=10.0)
DEADLINE = 600.0


def view(alive=0, rejoined=0, expected=0, armed=False, sealed=False, closed=False) -> RoundView:
    return RoundView(closed, sealed, alive, rejoined, expected, armed)


@pytest.mark.parametrize(
    "name, observed, now, armed_since, action, wake_at",
    [
        ("closed wins", view(alive=4, closed=True), 0, None, Action.CLOSED, None),
        ("sealed: read my rank", view(sealed=True), 0, None, Action.COLLECT, None),
        ("alone, below min: wait until the join deadline", view(alive=1), 0, None,
         Action.WAIT, DEADLINE),
        ("max reached: seal at once", view(alive=4), 0, None, Action.SEAL, None),
        ("more than max: seal at once", view(alive=5), 0, None, Action.SEAL, None),
        ("min reached, not armed: arm", view(alive=2), 0, None, Action.ARM, None),
        ("armed now: last call timer starts", view(alive=2, armed=True), 5, None,
         Action.WAIT, 15.0),
        ("armed earlier: timer keeps its start", view(alive=3, armed=True), 8, 5.0,
         Action.WAIT, 15.0),
        ("last call over: seal", view(alive=2, armed=True), 15, 5.0, Action.SEAL, None),
        ("fell below min after arming: wait", view(alive=1, armed=True), 20, 5.0,
         Action.WAIT, DEADLINE),
        ("join deadline passed", view(alive=1), DEADLINE, None, Action.TIMEOUT, None),
        ("deadline passed but max reached: seal", view(alive=4), DEADLINE + 1, None,
         Action.SEAL, None),
        ("last call capped by the join deadline", view(alive=2, armed=True), 595, 594.0,
         Action.WAIT, DEADLINE),
        # round r+1 while members of round r still work: closed to newcomers
        ("newcomers wait for the members", view(alive=4, expected=3), 0, None,
         Action.WAIT, DEADLINE),
        ("newcomers at min wait too", view(alive=2, expected=3), 0, None, Action.WAIT, DEADLINE),
        # re-rendezvous
        ("first member back opens the round", view(alive=3, rejoined=1, expected=3), 0, None,
         Action.ARM, None),
        ("all alive members back: fast path", view(alive=3, rejoined=3, expected=3), 0, None,
         Action.SEAL, None),
        ("all back plus a newcomer: fast path", view(alive=4, rejoined=3, expected=3), 0, None,
         Action.SEAL, None),
        ("all back but below min: wait", view(alive=1, rejoined=1, expected=1), 0, None,
         Action.WAIT, DEADLINE),
        ("previous round died out: newcomers form a round", view(alive=2, expected=0), 0, None,
         Action.ARM, None),
        ("one member missing: last call is the fallback", view(alive=3, rejoined=2, expected=3,
         armed=True), 1, 0.0, Action.WAIT, 10.0),
        ("missing member never came: seal after last call", view(alive=3, rejoined=2,
         expected=3, armed=True), 10, 0.0, Action.SEAL, None),
    ],
)
def test_decide(name, observed, now, armed_since, action, wake_at):
    step = decide(observed, RULES, float(now), DEADLINE, armed_since)
    assert step.action is action, name
    if wake_at is not None:
        assert step.wake_at == wake_at, name


def test_armed_since_is_carried_over():
    first = decide(view(alive=2, armed=True), RULES, 3.0, DEADLINE, None)
    assert first.armed_since == 3.0
    later = decide(view(alive=2, armed=True), RULES, 7.0, DEADLINE, first.armed_since)
    assert later.armed_since == 3.0 and later.wake_at == 13.0


def nodes(*specs: tuple[str, int | None] | tuple[str, int | None, int]) -> dict[str, NodeDescriptor]:
    """Joiners by node id: (``"host:pid"``, previous rank[, node_order]) each."""
    joiners = {}
    for spec, prev, *order in specs:
        host, pid = spec.split(":")
        node_id = f"{host}:{pid}:0a1b2c3d"
        joiners[node_id] = NodeDescriptor(node_id, host, int(pid), 1000, prev,
                                          order=order[0] if order else None)
    return joiners


def ranks(*pairs: tuple[str, int]) -> dict[str, int]:
    return {f"{spec}:0a1b2c3d": rank for spec, rank in pairs}


@pytest.mark.parametrize(
    "name, joiners, rules, expected",
    [
        ("below min: no round", nodes(("a:1", None)), RULES, None),
        ("first round: by host, then pid (numerically)",
         nodes(("b:1", None), ("a:20", None), ("a:3", None)), RULES,
         ranks(("a:3", 0), ("a:20", 1), ("b:1", 2))),
        ("survivors keep their ranks, newcomer fills the hole",
         nodes(("a:1", 2), ("b:1", 0), ("c:1", None)), RULES,
         ranks(("b:1", 0), ("a:1", 2), ("c:1", 1))),
        ("rank beyond the new size is renumbered", nodes(("a:1", 0), ("b:1", 3)), RULES,
         ranks(("a:1", 0), ("b:1", 1))),
        ("over max: survivors first, newcomers dropped",
         nodes(("a:1", None), ("b:1", 1), ("c:1", 0), ("d:1", 2), ("e:1", 3)), RULES,
         ranks(("c:1", 0), ("b:1", 1), ("d:1", 2), ("e:1", 3))),
        ("over max: newcomers in host order",
         nodes(("e:1", None), ("b:1", None), ("d:1", None), ("a:1", None), ("c:1", None)), RULES,
         ranks(("a:1", 0), ("b:1", 1), ("c:1", 2), ("d:1", 3))),
        ("duplicate previous rank (stale node) is renumbered", nodes(("a:1", 0), ("b:1", 0)),
         RULES, ranks(("a:1", 0), ("b:1", 1))),
        ("newcomers by node order (Slurm's node index) before host",
         nodes(("c:1", None, 0), ("a:1", None, 2), ("b:1", None, 1)), RULES,
         ranks(("c:1", 0), ("b:1", 1), ("a:1", 2))),
        ("newcomers without a node order come after those with one",
         nodes(("a:1", None), ("z:1", None, 0)), RULES, ranks(("z:1", 0), ("a:1", 1))),
        ("node order does not move survivors", nodes(("a:1", 1, 0), ("b:1", 0, 1)), RULES,
         ranks(("b:1", 0), ("a:1", 1))),
    ],
)
def test_plan_ranks(name, joiners, rules, expected):
    assert plan_ranks(joiners, rules) == expected, name


@pytest.mark.parametrize(
    "closed, waiting, rejoined, alive, world, newer, changed",
    [
        (False, 0, 0, 4, 2, False, False),
        (False, 1, 0, 2, 2, False, True),   # a newcomer, and room for it (max 4)
        (False, 1, 0, 4, 4, False, False),  # a spare: the round is full, it waits quietly
        (False, 2, 1, 4, 4, False, True),   # a member coming back (it restarts): re-form
        (False, 1, 0, 3, 4, False, True),   # a member lost or leaving: the spare takes its place
        (False, 0, 3, 4, 4, False, True),
        (True, 0, 0, 4, 4, False, True),
        (False, 0, 0, 4, 4, True, True),
        (False, 0, 0, 5, 4, False, False),  # a late joiner of the round has not moved on yet
    ],
)
def test_membership_changed(closed, waiting, rejoined, alive, world, newer, changed):
    assert membership_changed(closed, waiting, rejoined, alive, world, RULES.max_nodes,
                              newer) is changed


@pytest.mark.parametrize(
    "waiting, rejoined, alive, expected",
    [
        (0, 0, 2, 0),
        (1, 0, 2, 1),   # a newcomer, and room for it (max 4)
        (1, 0, 4, 0),   # a spare: max_nodes members alive
        (3, 1, 4, 1),   # a member coming back counts; the spares still do not
        (3, 1, 3, 3),
        (1, 0, 3, 1),   # a round of 4 lost a member: the node waiting takes its place (issue 22)
        (2, 0, 2, 2),   # ... two members lost, two nodes waiting
        (0, 0, 3, 0),   # a member lost, nobody waiting: nothing to count here
    ],
)
def test_nodes_waiting_leaves_out_the_spares(waiting, rejoined, alive, expected):
    assert nodes_waiting(waiting, rejoined, alive, RULES.max_nodes) == expected


@pytest.mark.parametrize(
    "alive, world, lost",
    [
        (2, 2, 0),
        (1, 2, 1),   # a member died, hung past its ttl or left
        (0, 2, 2),   # this node's own session expired too
        (3, 2, 0),   # a late joiner of the round has not moved on yet
    ],
)
def test_members_lost(alive, world, lost):
    assert members_lost(alive, world) == lost


@pytest.mark.parametrize(
    "name, observed, spare",
    [
        ("the running round is full and stays", view(alive=1, expected=4), True),
        ("a member is coming back: the round is open", view(alive=2, rejoined=1, expected=4),
         False),
        ("the running round has room", view(alive=1, expected=3), False),
        ("first round", view(alive=5), False),
        ("sealed", view(sealed=True, expected=4), False),
    ],
)
def test_a_spare_waits_without_a_deadline(name, observed, spare):
    assert is_spare(observed, RULES) is spare, name
    deadline = join_deadline(observed, RULES, DEADLINE + 5, DEADLINE, DEADLINE)
    assert deadline == (DEADLINE + 5 + DEADLINE if spare else DEADLINE), name
    if spare:  # past the join timeout all the same: it keeps waiting
        assert decide(observed, RULES, DEADLINE + 5, deadline, None).action is Action.WAIT


REAL = Decision(2, "10.0.0.1", 29500, "a1b2c3d4e5f60718")
STALE = Decision(3, "10.0.0.9", 29501, "ffffeeeeddddcccc")


@pytest.mark.parametrize(
    "name, record, status, verdict",
    [
        ("the record is the round's decision", REAL, REAL, Verdict.ACCEPT),
        ("a stale sealer's record, the real status: late", STALE, REAL, Verdict.LATE),
        ("the real record, a stale status over it: late", REAL, STALE, Verdict.LATE),
        ("same size and address, another seal: late", Decision(2, "10.0.0.1", 29500, "0" * 16),
         REAL, Verdict.LATE),
        ("records of rdzv before fencing (no seal) match their status", Decision(2, "h", 1),
         Decision(2, "h", 1), Verdict.ACCEPT),
        ("no record, sealed: late", None, REAL, Verdict.LATE),
        ("a record, no status yet: the decision is being written", REAL, None, Verdict.UNSEALED),
        ("no record, no status: not sealed", None, None, Verdict.UNSEALED),
        ("closed wins", REAL, True, Verdict.CLOSED),
        ("closed, no record", None, True, Verdict.CLOSED),
    ],
)
def test_check_rank(name, record, status, verdict):
    assert check_rank(record, status) is verdict, name
