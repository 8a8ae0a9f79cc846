"""The training chaos soak's measures and invariants: pure functions over what one run logged (no
I/O, no clock). Times are wall-clock seconds (``time.time()``), the clock of the example's lines.

What a run logged (:class:`Observed`): rank 0's progress (one :class:`Step` per step: the step
number reached, the world size, when), rank 0's parameter checks (one :class:`Check` after every
change of group: do all ranks hold the same parameters), the faults injected (a
:class:`Fault` whose ``at`` is the wall-clock time it was sent),
the measured window ``[start, end]``, the restarts the agents reported, and the processes left.

Definitions (``docs/train-chaos.md`` says the same):

* **gap**: the time between two consecutive step lines; the window's end closes the last one.
  A line is **new** if its step is above every step logged before it, **redone** if not,
  **skipped** if it is more than one above (steps missing).
* **median step**: the median gap between a line and the next new line one step further.
* **goodput**: the time of the normal steps / the window's wall time: the sum of the gaps that
  end in a new line and last at most ``NORMAL`` x the median step (clipped to the window),
  divided by ``end - start``. **goodput without stops** divides by the wall time less each
  SIGSTOP's pause (at most its length): a stopped node stops every data-parallel job alike.
* **attribution**: a gap is charged to the earliest fault injected inside it; a gap with no fault
  inside it to the latest fault before it (before the first fault: to none). A line is charged
  with the gap that ends in it.
* **pause** of a fault: the longest gap charged to it; a fault injected inside a gap charged to
  an earlier fault also counts the rest of that gap from its own injection.
* **redone** of a fault: the redone lines after a step went back (a line's step at most the
  previous line's) in a gap charged to it, up to the next new line; **skipped**: the step
  numbers that its lines skipped.
* **recovery**: from the end of the last fault (a stop's SIGCONT) to the next new line.
* **hang**: a gap longer than ``Limits.hang`` in the window (the nodes never all leave: at least
  MIN_NODES stay).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from train_chaos_schedule import PLANNED, Fault

NORMAL = 2.0
"""A gap up to this many median steps is a normal step."""


@dataclass(frozen=True)
class Step:
    step: int
    world: int
    t: float


@dataclass(frozen=True)
class Check:
    step: int
    world: int
    agree: bool
    t: float


@dataclass(frozen=True)
class Observed:
    """One launcher's run, as parsed from its files."""

    launcher: str
    start: float
    end: float
    steps: tuple[Step, ...]
    checks: tuple[Check, ...] = ()
    faults: tuple[Fault, ...] = ()
    restarts: int = 0
    """The agents' console lines that say they restart the workers."""
    leftovers: tuple[str, ...] = ()
    """Processes of the run found alive after its cleanup (or orphaned by a node that ended)."""
    in_process: bool = True
    """Whether the launcher keeps the workers through changes (then no step may be redone for
    a planned change, at most one per loss); restarting launchers resume from the checkpoint."""
    started: bool = True
    """Whether the job trained before the window (False: it never got going)."""


@dataclass(frozen=True)
class Limits:
    hang: float = 20.0
    """A gap longer than this is a hang."""
    recovery: float = 10.0
    """Training goes on at most this long after the end of the last fault."""


@dataclass(frozen=True)
class Violation:
    check: str
    message: str

    def describe(self, launcher: str) -> str:
        return f"VIOLATION {self.check} ({launcher}): {self.message}"


@dataclass(frozen=True)
class FaultEffect:
    fault: Fault
    pause: float
    redone: int
    skipped: int


@dataclass(frozen=True)
class Analysis:
    observed: Observed
    goodput: float
    goodput_without_stops: float
    median_step: float | None
    effects: tuple[FaultEffect, ...]
    recovery: float | None
    """Seconds from the end of the last fault to the next new step (None: no fault)."""
    violations: tuple[Violation, ...] = field(default=())

    def of_kind(self, kind: str) -> list[FaultEffect]:
        return [e for e in self.effects if e.fault.kind == kind]

    def disagreements(self) -> int:
        return sum(not c.agree for c in self.window_checks())

    def window_checks(self) -> list[Check]:
        return [c for c in self.observed.checks if c.t <= self.observed.end]

    def hangs(self) -> int:
        return sum(v.check == "hang" for v in self.violations)


# -- the progress -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Gap:
    begin: float
    """The line before (or the window's start, without one)."""
    line: Step | None
    """The line that ends the gap (None: the window's end does)."""
    best: int
    """The highest step logged before ``line``."""
    previous: int
    """The step of the line before (-1 without one)."""

    @property
    def end(self) -> float:
        assert self.line is not None
        return self.line.t

    def until(self, end: float) -> float:
        return (self.line.t if self.line is not None else end) - self.begin

    @property
    def new(self) -> bool:
        return self.line is not None and self.line.step > self.best


def gaps(steps: Iterable[Step], start: float, end: float) -> list[Gap]:
    """The window's gaps in order: the first from the last line before ``start`` (or from
    ``start``), the last closed by ``end`` if no line falls on it."""
    lines = sorted(steps, key=lambda s: s.t)
    before = [s for s in lines if s.t <= start]
    found: list[Gap] = []
    best = max((s.step for s in before), default=-1)
    begin, previous = (before[-1].t, before[-1].step) if before else (start, -1)
    for line in (s for s in lines if start < s.t <= end):
        found.append(Gap(begin, line, best, previous))
        best, begin, previous = max(best, line.step), line.t, line.step
    if begin < end:
        found.append(Gap(begin, None, best, previous))
    return found


def median_step(window: list[Gap]) -> float | None:
    normal = [g.end - g.begin for g in window if g.line is not None and g.line.step == g.best + 1]
    return statistics.median(normal) if normal else None


def productive(window: list[Gap], start: float, end: float, step: float | None) -> float:
    """Seconds of normal new steps in ``[start, end]``."""
    if step is None:
        return 0.0
    return sum(min(g.end, end) - max(g.begin, start) for g in window
               if g.new and g.end - g.begin <= NORMAL * step)


def charged(gap: Gap, faults: list[Fault], end: float) -> int | None:
    """The index of the fault ``gap`` is charged to (see the module's docstring)."""
    close = gap.line.t if gap.line is not None else end
    inside = [i for i, f in enumerate(faults) if gap.begin < f.at <= close]
    if inside:
        return inside[0]
    before = [i for i, f in enumerate(faults) if f.at <= gap.begin]
    return before[-1] if before else None


def effects(window: list[Gap], faults: list[Fault], end: float) -> list[FaultEffect]:
    pauses: dict[int, float] = defaultdict(float)
    redone: dict[int, int] = defaultdict(int)
    skipped: dict[int, int] = defaultdict(int)
    rollback: int | None = None  # the fault charged with the last gap where the step went back
    for gap in window:
        owner = charged(gap, faults, end)
        length = gap.until(end)
        for i, fault in enumerate(faults):  # faults inside a gap charged to an earlier one
            if owner is not None and i > owner and gap.begin < fault.at <= gap.begin + length:
                pauses[i] = max(pauses[i], gap.begin + length - fault.at)
        if owner is not None:
            pauses[owner] = max(pauses[owner], length)
        if gap.line is None:
            continue
        if gap.line.step <= gap.previous:
            rollback = owner
        if gap.line.step <= gap.best and rollback is not None:
            redone[rollback] += 1
        if owner is not None and gap.best >= 0:
            skipped[owner] += max(0, gap.line.step - gap.best - 1)
    return [FaultEffect(f, round(pauses[i], 3), redone[i], skipped[i])
            for i, f in enumerate(faults)]


def recovery(window: list[Gap], faults: list[Fault], end: float) -> float | None:
    """From the end of the last fault to the next new line (to ``end`` if none: a bound)."""
    if not faults:
        return None
    last = max(f.end for f in faults)
    first = next((g.end for g in window if g.new and g.end > last), end)
    return max(0.0, first - last)


RESTART_LINES = {"rdzv": ("restarting the workers", "re-forming the group"),
                 "torchrun": ("Stopping worker group",)}
"""What an agent's console line says when it restarts its workers: rdzv's agent (a failed
worker, a fallback from an in-process change, a loss without it) and torchrun's (with
``LOGLEVEL=INFO``: its ``_restart_workers``, for a failure or for new nodes)."""


def count_restarts(launcher: str, console: str) -> int:
    """The lines of an agent's ``console`` output that say it restarts its workers."""
    if launcher.startswith("rdzv"):
        lines = [line for line in console.splitlines() if line.startswith("[rdzv ")]
        return sum(any(p in line for p in RESTART_LINES["rdzv"]) for line in lines)
    return sum(any(p in line for p in RESTART_LINES["torchrun"]) for line in console.splitlines())


def parse_steps(entries: Iterable[dict[str, Any]]) -> tuple[Step, ...]:
    """Rank 0's progress lines (``--progress``) as steps."""
    return tuple(Step(e["step"], e["world_size"], e["time"]) for e in entries)


def parse_checks(entries: Iterable[dict[str, Any]]) -> tuple[Check, ...]:
    """Rank 0's parameter checks (``--checks``)."""
    return tuple(Check(e["step"], e["world_size"], e["agree"], e["time"]) for e in entries)


# -- the invariants ---------------------------------------------------------------------------
def check_agreement(observed: Observed) -> list[Violation]:
    return [Violation("disagreement", f"ranks hold different parameters at step {c.step}, world "
                      f"size {c.world} ({c.t - observed.start:+.1f} s)")
            for c in observed.checks if not c.agree and c.t <= observed.end]


def check_hangs(window: list[Gap], observed: Observed, limits: Limits) -> list[Violation]:
    if not observed.started:
        return [Violation("hang", "the job never trained at its starting size")]
    return [Violation("hang", f"no step for {g.until(observed.end):.1f} s from "
                      f"{g.begin - observed.start:+.1f} s (bound {limits.hang:g} s)")
            for g in window if g.until(observed.end) > limits.hang]


def check_recovery(observed: Observed, after: float | None, limits: Limits) -> list[Violation]:
    if after is None or after <= limits.recovery:
        return []
    return [Violation("recovery", f"no new step within {limits.recovery:g} s of the last fault's "
                      f"end (first after {after:.1f} s)")]


def check_redone(found: list[FaultEffect], observed: Observed) -> list[Violation]:
    """In-process launchers: planned changes keep the steps consecutive; a loss redoes at most
    one step."""
    if not observed.in_process:
        return []
    violations = []
    for effect in found:
        fault, when = effect.fault, effect.fault.at - observed.start
        if fault.kind in PLANNED and (effect.redone or effect.skipped):
            violations.append(Violation("planned-redone", f"{fault.kind} of node {fault.node} at "
                                        f"{when:.1f} s: {effect.redone} step(s) redone, "
                                        f"{effect.skipped} skipped"))
        elif fault.kind not in PLANNED and effect.redone > 1:
            violations.append(Violation("loss-redone", f"{fault.kind} of node {fault.node} at "
                                        f"{when:.1f} s: {effect.redone} steps redone"))
    return violations


def check_leftovers(observed: Observed) -> list[Violation]:
    return [Violation("leftover", left) for left in observed.leftovers]


def analyse(observed: Observed, limits: Limits = Limits()) -> Analysis:
    start, end = observed.start, observed.end
    faults = sorted(observed.faults, key=lambda f: f.at)
    window = gaps(observed.steps, start, end)
    step = median_step(window)
    found = effects(window, faults, end)
    normal = productive(window, start, end, step)
    stopped = sum(min(e.pause, e.fault.length) for e in found if e.fault.kind == "stop")
    after = recovery(window, faults, end)
    violations = (check_agreement(observed) + check_hangs(window, observed, limits)
                  + check_recovery(observed, after, limits) + check_redone(found, observed)
                  + check_leftovers(observed))
    wall = max(end - start, 1e-9)
    return Analysis(observed, normal / wall, normal / max(wall - stopped, 1e-9), step,
                    tuple(found), after, tuple(violations))


# -- the targets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    name: str
    launcher: str
    value: str
    met: bool


def targets(analyses: list[Analysis], limits: Limits = Limits()) -> list[Target]:
    """Issue 22's targets, per launcher, then the goodput ratios of ``rdzv`` to the others."""
    found = []
    for a in analyses:
        who = a.observed.launcher
        moving = [e.pause for e in a.effects if e.fault.kind != "stop"]
        stops = [e.pause - e.fault.length for e in a.effects if e.fault.kind == "stop"]
        planned = sum(e.redone for e in a.effects if e.fault.kind in PLANNED)
        found += [
            Target("goodput (stops taken out) >= 0.95", who, f"{a.goodput_without_stops:.3f}",
                   a.goodput_without_stops >= 0.95),
            Target("every pause <= 1 s (stops apart)", who, seconds(max(moving, default=0.0)),
                   max(moving, default=0.0) <= 1.0),
            Target("median pause <= 0.3 s (stops apart)", who,
                   seconds(statistics.median(moving) if moving else 0.0),
                   not moving or statistics.median(moving) <= 0.3),
            Target("0 steps redone for joins and leaves", who, str(planned), planned == 0),
            Target("SIGSTOP pause <= its length + 0.5 s", who,
                   f"{max(stops):+.2f} s" if stops else "-", max(stops, default=0.0) <= 0.5),
            Target(f"training again within {limits.recovery:g} s of the last fault", who,
                   seconds(a.recovery), a.recovery is None or a.recovery <= limits.recovery),
            Target("0 disagreements, 0 hangs, 0 leftovers", who,
                   f"{a.disagreements()}, {a.hangs()}, {len(a.observed.leftovers)}",
                   not (a.disagreements() or a.hangs() or a.observed.leftovers)),
        ]
    by_name = {a.observed.launcher: a for a in analyses}
    reference = by_name.get("rdzv")
    for other, ratio in (("rdzv-restart", 1.5), ("torchrun-rdzv-tcp", 2.5)):
        if reference is not None and other in by_name:
            value = ratio_of(reference.goodput, by_name[other].goodput)
            found.append(Target(f"rdzv goodput >= {ratio:g}x {other}", "rdzv",
                                f"{value:.2f}x", value >= ratio))
    return found


def ratio_of(ours: float, theirs: float) -> float:
    return ours / theirs if theirs > 0 else float("inf")


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def summary(analysis: Analysis) -> dict[str, Any]:
    """The figures of one run, as JSON."""
    o = analysis.observed
    return {
        "launcher": o.launcher, "window_s": round(o.end - o.start, 3),
        "goodput": round(analysis.goodput, 4),
        "goodput_without_stops": round(analysis.goodput_without_stops, 4),
        "median_step_s": analysis.median_step, "recovery_s": analysis.recovery,
        "restarts": o.restarts, "checks": len(analysis.window_checks()),
        "disagreements": analysis.disagreements(), "leftovers": list(o.leftovers),
        "faults": [{"at_s": round(e.fault.at - o.start, 3), "kind": e.fault.kind,
                    "node": e.fault.node, "length_s": e.fault.length, "pause_s": e.pause,
                    "redone": e.redone, "skipped": e.skipped} for e in analysis.effects],
        "violations": [{"check": v.check, "message": v.message} for v in analysis.violations],
    }
