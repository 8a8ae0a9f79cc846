"""The training chaos soak's measures and invariants on hand-made runs: one good, and one for each
way to fail; the schedule's promises."""

from __future__ import annotations

from dataclasses import replace

import pytest
from train_chaos_checks import Check, Observed, Step, analyse, count_restarts, targets
from train_chaos_schedule import (INITIAL_NODES, KINDS, MAX_NODES, MIN_NODES, REMOVALS, Fault,
                                  plan)

STEP = 0.06
START, END = 100.0, 160.0


def train(first: int, begin: float, end: float, world: int = 3) -> list[Step]:
    """Steps ``first``, ``first + 1``, ... every STEP seconds from ``begin`` until ``end``."""
    count = int(round((end - begin) / STEP))
    return [Step(first + i, world, begin + i * STEP) for i in range(count)]


def resume(steps: list[Step], at: float, back: int, end: float, world: int = 3) -> list[Step]:
    """``steps`` until ``at``, then training again from ``back`` steps before the last one."""
    kept = [s for s in steps if s.t < at]
    return kept + train(kept[-1].step + 1 - back, at, end, world)


def pause(steps: list[Step], begin: float, length: float) -> list[Step]:
    """No step from ``begin`` for ``length`` seconds; the steps go on from there."""
    return [s for s in steps if s.t < begin] + [
        replace(s, t=s.t + length) for s in steps if s.t >= begin]


STEADY = train(1, START - 5.0, END + 1.0)
FAULTS = (Fault(110.0, "join", 3), Fault(120.0, "kill", 1), Fault(130.0, "stop", 2, 2.0),
          Fault(140.0, "leave", 0))
GOOD_STEPS = pause(resume(pause(pause(STEADY, 110.05, 0.1), 120.05, 0.3), 120.5, 1, END),
                   130.02, 2.1)
GOOD = Observed("rdzv", START, END, tuple(GOOD_STEPS),
                (Check(0, 3, True, 95.0), Check(300, 4, True, 110.2)), FAULTS)


def run(steps: list[Step], **changes: object) -> Observed:
    return replace(GOOD, steps=tuple(steps), **changes)


@pytest.mark.parametrize("observed, found", [
    (GOOD, []),
    (replace(GOOD, checks=GOOD.checks + (Check(400, 3, False, 121.0),)), ["disagreement"]),
    (replace(GOOD, checks=GOOD.checks + (Check(900, 3, False, END + 5.0),)), []),
    (run(pause(GOOD_STEPS, 125.0, 22.0), faults=FAULTS[:2]), ["hang"]),
    (run(pause(GOOD_STEPS, 140.01, 12.0)), ["recovery"]),
    (run([s for s in GOOD_STEPS if s.t < 135.0]), ["hang", "recovery"]),
    (run(resume(GOOD_STEPS, 110.2, 3, END)), ["planned-redone"]),
    (run([s for s in GOOD_STEPS if not 140.0 < s.t < 140.1]), ["planned-redone"]),
    (run(resume(GOOD_STEPS, 120.6, 2, END)), ["loss-redone"]),
    (run(resume(resume(GOOD_STEPS, 110.2, 3, END), 120.6, 5, END), in_process=False), []),
    (replace(GOOD, leftovers=("pid 7 (python elastic_train.py) alive after the cleanup",)),
     ["leftover"]),
    (replace(GOOD, steps=(), faults=(), started=False), ["hang"]),
], ids=["good", "disagreement", "disagreement-after-the-window", "hang", "no-recovery",
        "stuck-at-the-end", "join-redoes-steps", "leave-skips-steps", "kill-redoes-two-steps",
        "restarting-launcher-may-redo", "leftover", "never-started"])
def test_invariants(observed: Observed, found: list[str]) -> None:
    violations = analyse(observed).violations
    assert sorted({v.check for v in violations}) == found, [v.describe("x") for v in violations]


def test_each_fault_gets_its_pause_and_redone_steps() -> None:
    effects = analyse(GOOD).effects
    assert [e.fault.kind for e in effects] == ["join", "kill", "stop", "leave"]
    assert [e.pause for e in effects] == pytest.approx([0.16, 0.36, 2.16, STEP], abs=0.011)
    assert [(e.redone, e.skipped) for e in effects] == [(0, 0), (1, 0), (0, 0), (0, 0)]


def test_goodput_counts_normal_new_steps_only() -> None:
    steady = analyse(run(STEADY))
    assert steady.goodput == pytest.approx(1.0, abs=0.002)
    assert steady.median_step == pytest.approx(STEP)
    good = analyse(GOOD)  # 0.1 + 0.3 + 2.1 s of pauses, one step redone
    lost = 0.1 + 0.3 + 2.1 + 4 * STEP
    assert good.goodput == pytest.approx((60.0 - lost) / 60.0, abs=0.002)
    assert good.goodput_without_stops == pytest.approx((60.0 - lost) / (60.0 - 2.0), abs=0.002)


def test_a_slow_step_is_not_normal() -> None:
    slow = analyse(run(pause(STEADY, 130.0, 0.2)))  # one step of 0.26 s > 2 x 0.06 s
    assert slow.goodput == pytest.approx((60.0 - 0.26) / 60.0, abs=0.002)


def test_a_fault_inside_an_earlier_faults_pause_gets_the_rest_of_it() -> None:
    faults = (Fault(120.0, "kill", 1), Fault(121.0, "join", 3))
    effects = analyse(run(pause(STEADY, 119.99, 3.0), faults=faults)).effects  # 119.96 -> 123.02
    assert [e.pause for e in effects] == pytest.approx([3.06, 2.02], abs=0.001)


def test_a_pause_that_begins_after_the_fault_is_the_faults() -> None:
    faults = (Fault(120.0, "worker-crash", 1), Fault(130.0, "join", 3))
    effects = analyse(run(pause(STEADY, 122.0, 4.0), faults=faults)).effects
    assert [e.pause for e in effects] == pytest.approx([4.0 + STEP, STEP], abs=0.011)


def test_redone_steps_go_to_the_fault_that_set_the_step_back() -> None:
    """A restart after a kill redoes steps; a join injected while they are redone is not charged."""
    steps = resume(pause(STEADY, 120.0, 3.0), 123.05, 5, END)
    faults = (Fault(120.0, "kill", 1), Fault(123.1, "join", 3))
    effects = analyse(run(steps, faults=faults)).effects
    assert [(e.fault.kind, e.redone) for e in effects] == [("kill", 5), ("join", 0)]


def test_recovery_counts_from_the_end_of_the_last_stop() -> None:
    faults = (Fault(120.0, "stop", 1, 4.0),)
    analysis = analyse(run(pause(STEADY, 119.99, 4.5), faults=faults))  # 119.96 -> 124.52
    assert analysis.recovery == pytest.approx(0.52, abs=0.001)


def test_agents_restart_lines() -> None:
    rdzv = ("[rdzv 12:00:01] restarting the workers in the new round: group rank 0 restarts\n"
            "[0]:restarting the workers is what the example prints\n"
            "[rdzv 12:00:02] global rank 1 ended with signal SIGKILL (9); restarting the workers "
            "(restart 1 of 1000)\n"
            "[rdzv 12:00:03] a member was lost: re-forming the group (not counted as a restart)\n")
    torchrun = ("I1126 21:25:44.83 5552 torch/distributed/elastic/agent/server/api.py:733] "
                "[default] Stopping worker group\n[default] Starting worker group\n")
    assert count_restarts("rdzv", rdzv) == 3
    assert count_restarts("torchrun-rdzv-tcp", torchrun) == 1


def test_targets_and_ratios() -> None:
    """A restart after the kill: 16 s without a step, 8 steps redone; rdzv's run is GOOD."""
    restarting = analyse(run(resume(pause(STEADY, 120.0, 16.0), 136.05, 8, END),
                             launcher="rdzv-restart", in_process=False))
    found = {(t.launcher, t.name): (t.value, t.met) for t in targets([analyse(GOOD), restarting])}
    assert found["rdzv", "every pause <= 1 s (stops apart)"] == ("0.36 s", True)
    assert found["rdzv", "SIGSTOP pause <= its length + 0.5 s"] == ("+0.16 s", True)
    assert found["rdzv", "goodput (stops taken out) >= 0.95"] == ("0.988", True)
    assert found["rdzv-restart", "every pause <= 1 s (stops apart)"] == ("16.06 s", False)
    assert found["rdzv-restart", "0 steps redone for joins and leaves"] == ("0", True)
    assert found["rdzv", "rdzv goodput >= 1.5x rdzv-restart"] == ("1.32x", False)
    assert ("rdzv", "rdzv goodput >= 2.5x torchrun-rdzv-tcp") not in found


def test_one_seed_gives_one_schedule_with_every_kind_first() -> None:
    schedule = plan(22, 100.0, 8.0, KINDS)
    assert schedule == plan(22, 100.0, 8.0, KINDS) != plan(23, 100.0, 8.0, KINDS)
    assert sorted({f.kind for f in schedule[:len(KINDS) + 1]}) == sorted(KINDS)
    assert all(0 < f.at <= 100.0 for f in schedule)


@pytest.mark.parametrize("kinds", [KINDS, ("kill",), ("leave", "stop"), ("join",)])
@pytest.mark.parametrize("seed", range(20))
def test_the_schedule_keeps_the_population(seed: int, kinds: tuple[str, ...]) -> None:
    alive, started, stopped_until = set(range(INITIAL_NODES)), INITIAL_NODES, {}
    for fault in plan(seed, 200.0, 8.0, kinds):
        if fault.kind == "join":
            assert fault.node == started
            alive.add(fault.node)
            started += 1
        else:
            assert fault.node in alive and stopped_until.get(fault.node, 0.0) <= fault.at
        if fault.kind in REMOVALS:
            alive.remove(fault.node)
        if fault.kind == "stop":
            assert 1.0 <= fault.length <= 6.0
            stopped_until[fault.node] = fault.end
        assert MIN_NODES <= len(alive) <= MAX_NODES
        assert fault.kind in kinds or fault.kind == "join" and any(k in REMOVALS for k in kinds)
