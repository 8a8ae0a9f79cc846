"""The workers' health as tables, without processes or clocks: the hang watch of a node's
protocol (``rdzv/agent/_hang.py``, through the protocol's ``step``) and group rank 0's straggler
verdicts (``rdzv/agent/_stragglers.py``)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from rdzv._messages import Hello, Progress, Where
from rdzv.agent._hang import HANG_FLOOR, HANG_STEPS, PROBE_GRACE, hang_due
from rdzv.agent._moves import signalled
from rdzv.agent._protocol import (
    Evicted,
    FromWorker,
    Leave,
    Node,
    Phase,
    Rules,
    Signalled,
    Tick,
    Worker,
)
from rdzv.agent._rules import step
from rdzv.agent._stragglers import BACKOFF, WINDOW, Policy, Sample, Watch, assess, clear_at
from test_node_protocol import RULES, running

NOW = 1000.0
TIMEOUT = 5.0
WATCHED = replace(RULES, hang_timeout=TIMEOUT)


def reporting(phase: Phase = Phase.RUNNING, **slot: Any) -> Node:
    """A node whose worker last reported a step (0.1 s per step) at NOW."""
    node = running()
    fields = {"step_time": 0.1, "longest": 0.1, "sampled": NOW, **slot}
    slots = (replace(node.slots[0], **fields),)
    return replace(node, phase=phase, slots=slots)


def acts_of(node: Node, event: Any, at: float, rules: Rules = WATCHED) -> tuple[Node, list[str]]:
    moved, acts = step(node, event, at, rules)
    return moved, [a.what for a in acts]


# -- the hang watch ---------------------------------------------------------------------------
@pytest.mark.parametrize("phase", [Phase.RUNNING, Phase.FORMING, Phase.SETTLING,
                                   Phase.AWAITING])
def test_a_worker_silent_for_the_timeout_is_asked_where_it_is(phase: Phase) -> None:
    node = reporting(phase)
    assert hang_due(node, WATCHED) == NOW + TIMEOUT
    assert acts_of(node, Tick(), NOW + TIMEOUT - 0.01)[1] == []
    moved, acts = acts_of(node, Tick(), NOW + TIMEOUT)
    assert acts == ["probe"] and moved.slots[0].probed == NOW + TIMEOUT


@pytest.mark.parametrize("node, why", [
    (reporting(Phase.ENTERING), "its group changes (bounded by --switch-timeout)"),
    (reporting(state=Worker.BROKEN), "its group failed: it waits for a plan"),
    (reporting(step_time=None), "no step time yet: a first step may compile or warm up"),
    (replace(reporting(), leave=Leave(15, NOW + 30, announced=True)), "its node leaves"),
    (replace(reporting(), inprocess=False), "a program without the in-process API"),
])
def test_no_watch(node: Node, why: str) -> None:
    assert hang_due(node, WATCHED) == math.inf, why
    assert acts_of(node, Tick(), NOW + 2 * TIMEOUT)[1] == [], why


def test_the_default_timeout_follows_the_slowest_step_with_a_floor() -> None:
    auto = replace(RULES, hang_timeout=None)
    assert hang_due(reporting(), auto) == NOW + HANG_FLOOR
    slow = reporting(step_time=18.0, longest=20.0)
    assert hang_due(slow, auto) == NOW + HANG_STEPS * 20.0
    assert hang_due(reporting(), replace(RULES, hang_timeout=0)) == math.inf  # 0: off


def test_progress_clears_the_question_and_the_clock() -> None:
    node, _ = acts_of(reporting(), Tick(), NOW + TIMEOUT)
    moved, acts = acts_of(node, FromWorker(0, Progress(41, 0.1, 0.08, 0.02)), NOW + TIMEOUT + 0.2)
    slot = moved.slots[0]
    assert acts == [] and slot.probed is None and slot.sampled == NOW + TIMEOUT + 0.2
    assert (slot.step, slot.compute, slot.wait) == (41, 0.08, 0.02)


def test_a_worker_in_its_own_code_is_hung_and_ended() -> None:
    node, _ = acts_of(reporting(), Tick(), NOW + TIMEOUT)
    moved, acts = step(node, FromWorker(0, Where(40, False, "train.py:7 in train")),
                       NOW + TIMEOUT + 0.01, WATCHED)
    assert [a.what for a in acts] == ["hung"] and moved.slots[0].hung
    local_rank, rank, step_, silent, why, frame = acts[0].args
    assert (local_rank, rank, step_, frame) == (0, 1, 40, "train.py:7 in train")
    assert silent == pytest.approx(TIMEOUT + 0.01) and "own code" in why
    assert hang_due(moved, WATCHED) == math.inf  # declared once: its end follows


def test_a_worker_that_does_not_answer_is_hung() -> None:
    node, _ = acts_of(reporting(), Tick(), NOW + TIMEOUT)
    assert hang_due(node, WATCHED) == NOW + TIMEOUT + PROBE_GRACE
    moved, acts = acts_of(node, Tick(), NOW + TIMEOUT + PROBE_GRACE)
    assert acts == ["hung"] and moved.slots[0].hung


def test_a_worker_waiting_for_a_peer_is_not_the_culprit_until_twice_the_timeout() -> None:
    node, _ = acts_of(reporting(), Tick(), NOW + TIMEOUT)
    node, acts = acts_of(node, FromWorker(0, Where(40, True, "")), NOW + TIMEOUT + 0.01)
    assert acts == ["say"] and not node.slots[0].hung  # "waits in a collective", once
    again = NOW + TIMEOUT + 0.01 + TIMEOUT / 2
    assert hang_due(node, WATCHED) == again
    node, acts = acts_of(node, Tick(), again)
    assert acts == ["probe"]
    node, acts = acts_of(node, FromWorker(0, Where(40, True, "")), again + 0.01)
    assert acts == []  # said once already
    due = hang_due(node, WATCHED)
    assert due >= NOW + 2 * TIMEOUT
    node, _ = acts_of(node, Tick(), due)
    node, acts = acts_of(node, FromWorker(0, Where(40, True, "")), due + 0.01)
    assert acts == ["hung"]  # nobody acted: it may not wait forever either


def test_an_answer_nobody_asked_for_is_ignored() -> None:
    assert acts_of(reporting(), FromWorker(0, Where(40, False, "")), NOW + 1)[1] == []


def test_a_new_process_in_the_slot_starts_with_a_clean_watch() -> None:
    hung = reporting(hung=True, probed=NOW, step=40)
    moved, _ = acts_of(hung, FromWorker(0, Hello(0, 4242)), NOW + 9)
    slot = moved.slots[0]
    assert not slot.hung and slot.probed is None and slot.step_time is None
    assert slot.sampled == NOW + 9


# -- asked to leave as a straggler -------------------------------------------------------------
def test_an_evicted_node_leaves_gracefully() -> None:
    moved, acts = acts_of(running(), Evicted("a straggler at 2.00x"), NOW, RULES)
    assert acts == ["say", "announce"] and moved.leave is not None and moved.leave.announced


@pytest.mark.parametrize("node, rules, why", [
    (running(nodes=1), RULES, "alone in its round"),
    (running(nodes=2), replace(RULES, min_nodes=2), "cannot go on without this one"),
    (running(), replace(RULES, hosts_store=True), "serves the rendezvous store"),
    (replace(running(), leave=Leave(15, NOW + 30, announced=True)), RULES, "already leaving"),
    (replace(running(), phase=Phase.FINISHED), RULES, "already leaving or done"),
])
def test_an_evicted_node_that_cannot_leave_gracefully_stays(node: Node, rules: Rules,
                                                            why: str) -> None:
    moved, acts = step(node, Evicted("a straggler"), NOW, rules)
    assert moved == node and [a.what for a in acts] == ["say"] and why in acts[0].args[0]


def test_an_evicted_node_in_a_transition_leaves_once_it_is_over() -> None:
    node = replace(running(), phase=Phase.FORMING)
    moved, acts = acts_of(node, Evicted("a straggler"), NOW, RULES)
    assert acts == ["say"] and moved.leave is not None and not moved.leave.announced
    assert moved.leave.notice.startswith("asked to leave")


def test_an_evicted_node_that_can_no_longer_leave_after_the_transition_stays() -> None:
    node = replace(running(nodes=2), phase=Phase.FORMING)
    pending, _ = step(node, Evicted("a straggler"), NOW, RULES)
    rules = replace(RULES, min_nodes=2)  # the transition left it needed
    over = replace(pending, phase=Phase.RUNNING)  # as running() does, then asks signalled()
    moved, acts = signalled(over, Signalled(over.leave.signum, over.leave.notice), NOW, rules,
                            pending=True)
    assert moved.leave is None and moved.phase is Phase.RUNNING
    assert [a.what for a in acts] == ["say"] and "it stays" in acts[0].args[0]


# -- stragglers -------------------------------------------------------------------------------
POLICY = Policy(factor=1.5)


def samples(*works: float | None, hosts: tuple[str, ...] = ()) -> list[Sample]:
    return [Sample(rank, f"n{rank}", hosts[rank] if hosts else f"h{rank}", work)
            for rank, work in enumerate(works)]


def play(rows: list[list[Sample]], policy: Policy = POLICY, spares: int = 0,
         watch: Watch | None = None, start: float = 0.0) -> tuple[Watch, list[tuple[str, str]]]:
    watch = watch or Watch()
    said = []
    for i, row in enumerate(rows):
        watch, verdicts = assess(watch, row, spares, start + 5.0 * i, policy)
        said += [(v.kind, v.sample.node) for v in verdicts]
    return watch, said


def test_a_node_twice_as_slow_for_a_window_is_flagged_once() -> None:
    watch, said = play([samples(0.05, 0.05, 0.10)] * (WINDOW + 3))
    assert said == [("flagged", "n2")] and watch.flagged == {"n2"}


@pytest.mark.parametrize("rows, why", [
    ([samples(0.05, 0.05, 0.10)] * (WINDOW - 1), "not for a whole window yet"),
    ([samples(0.05, 0.05, 0.10), samples(0.05, 0.05, 0.06)] * WINDOW, "a blip now and then"),
    ([samples(0.05, 0.06, 0.07)] * 10, "within the factor"),
    ([samples(None, 0.10)] * 10 + [samples(0.05)], "nobody else trains: nobody to compare"),
    ([samples(0.0001, 0.0001, 0.0003)] * 10, "no work to speak of (idle)"),
])
def test_no_flag(rows: list[list[Sample]], why: str) -> None:
    assert play(rows)[1] == [], why


def test_two_nodes_compare_with_each_other() -> None:
    assert play([samples(0.05, 0.11)] * WINDOW)[1] == [("flagged", "n1")]


def test_a_flag_clears_only_well_under_the_factor() -> None:
    watch, _ = play([samples(0.05, 0.05, 0.10)] * WINDOW)
    near = 0.05 * (clear_at(1.5) + 0.05)
    watch, said = play([samples(0.05, 0.05, near)] * 5, watch=watch)
    assert said == [] and watch.flagged == {"n2"}  # between the bounds: no flapping
    watch, said = play([samples(0.05, 0.05, 0.055)] * WINDOW, watch=watch)
    assert said == [("cleared", "n2")] and watch.flagged == frozenset()


def test_a_flag_follows_the_node_not_its_rank() -> None:
    watch, _ = play([samples(0.05, 0.05, 0.10)] * WINDOW)
    moved = [Sample(0, "n2", "h2", 0.10), Sample(1, "n0", "h0", 0.05)]  # a new round's ranks
    watch, said = play([moved], watch=watch)
    assert said == [] and watch.flagged == {"n2"}
    gone, said = play([samples(0.05, 0.05)], watch=watch)  # it left: its flag goes with it
    assert gone.flagged == frozenset() and said == []


REPLACE = Policy(factor=1.5, replace=True, min_nodes=2)


def test_a_straggler_is_replaced_when_a_spare_waits() -> None:
    rows = [samples(0.05, 0.05, 0.10)] * WINDOW
    assert play(rows, REPLACE, spares=0)[1] == [("flagged", "n2")]  # no spare: only a flag
    watch, said = play(rows, REPLACE, spares=1)
    assert said == [("flagged", "n2"), ("replaced", "n2")] and watch.pending == ("n2", 10.0)
    watch, said = play(rows, REPLACE, spares=1, watch=watch)
    assert said == []  # asked already; it is leaving


def test_never_below_min_nodes() -> None:
    rows = [samples(0.05, 0.10)] * WINDOW
    assert play(rows, REPLACE, spares=1)[1] == [("flagged", "n1")]


def test_one_at_a_time_the_slowest_first() -> None:
    rows = [samples(0.05, 0.05, 0.05, 0.09, 0.12)] * WINDOW
    watch, said = play(rows, REPLACE, spares=2)
    assert [s for s in said if s[0] == "replaced"] == [("replaced", "n4")]
    watch, said = play([samples(0.05, 0.05, 0.05, 0.09)], REPLACE, spares=2, watch=watch,
                       start=100.0)
    assert said == [("replaced", "n3")]  # n4 left: the next one


def test_a_host_that_comes_back_slow_backs_off() -> None:
    slow = samples(0.05, 0.05, 0.10)
    watch, said = play([slow] * WINDOW, REPLACE, spares=1)
    assert ("replaced", "n2") in said
    back = samples(0.05, 0.05) + [Sample(2, "n3", "h2", 0.10)]  # the same host, anew
    watch, said = play([back] * WINDOW, REPLACE, spares=1, watch=watch, start=100.0)
    assert said == [("flagged", "n3")]  # flagged, not asked again within the back-off
    watch, said = play([back], REPLACE, spares=1, watch=watch, start=BACKOFF + 20.0)
    assert said == [("replaced", "n3")]
    assert watch.asked["h2"][1] == 2 * BACKOFF  # and the next back-off is longer


def test_off() -> None:
    assert play([samples(0.05, 0.5)] * 10, Policy(factor=0))[1] == []
