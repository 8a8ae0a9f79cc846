"""Stragglers: which node the others wait for, decided by group rank 0's agent from every node's
step times (pure: the samples and the time come with each call).

Every node publishes, with its sign of life (every ``heartbeat_every``: 5 s by default), its
workers' recent work per step, the *compute* time (``rdzv.torch._steptime``: a step less the
wait for the gradients' reduction). In a synchronous job every rank's step takes as long as the
slowest one's, so step times cannot tell who is slow; the work can. At each sample group rank 0
compares each node's work with the median of the *other* nodes' (the ratio). A node whose ratio
is at least ``factor`` in ``WINDOW`` samples in a row (about 15 s) is flagged; it is cleared
once its ratio stays under ``clear_at(factor)`` for as many samples (a hysteresis: a node near
the bound does not flap between the two).

With ``replace`` (``--replace-stragglers``), a flagged node is asked to leave gracefully when a
spare waits to take its place, never below ``min_nodes``, one at a time; a host asked once is
not asked again before ``BACKOFF`` (doubled at each time), so a node that keeps coming back slow
is not evicted over and over.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

WINDOW = 3
"""Samples in a row (one per sign of life) that flag a straggler or clear it."""
BACKOFF = 600.0
"""Seconds before a host asked to leave as a straggler may be asked again (doubled each time)."""
PENDING_FOR = 120.0
"""Seconds a node asked to leave has to go; one still a member then stays (it could not leave
gracefully, or said so), and another straggler may be asked."""
MIN_WORK = 0.001
"""Seconds per step below which work is too small to compare (an idle or finished node)."""


@dataclass(frozen=True)
class Sample:
    """One node's sign of life, as group rank 0 read it."""

    group_rank: int
    node: str
    """Its node id (a straggler's flag follows the node across rounds)."""
    host: str
    compute: float | None
    """Its workers' work per step (the slowest local rank's); None: not training now."""


@dataclass(frozen=True)
class Verdict:
    """Something to do about one node: ``flagged``, ``cleared`` or ``replaced`` (asked to leave
    for a spare)."""

    kind: str
    sample: Sample
    ratio: float


@dataclass(frozen=True)
class Watch:
    """What group rank 0 remembers between samples."""

    ratios: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Node id -> its last ratios (at most ``WINDOW``)."""
    flagged: frozenset[str] = frozenset()
    asked: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Host -> (when it was last asked to leave, the back-off then)."""
    pending: tuple[str, float] | None = None
    """The node asked to leave that is still a member, and when (one at a time)."""


@dataclass(frozen=True)
class Policy:
    factor: float
    replace: bool = False
    min_nodes: int = 1


def clear_at(factor: float) -> float:
    """The ratio under which a flagged node is cleared: half-way back to 1."""
    return 1 + (factor - 1) / 2


def assess(watch: Watch, samples: list[Sample], spares: int, now: float,
           policy: Policy) -> tuple[Watch, list[Verdict]]:
    """The next watch and what to do, after one sample of every node of the round."""
    if policy.factor <= 0:
        return watch, []
    works = {s.node: s.compute for s in samples
             if s.compute is not None and s.compute >= MIN_WORK}
    ratios: dict[str, tuple[float, ...]] = {}
    verdicts: list[Verdict] = []
    flagged = set(watch.flagged & {s.node for s in samples})
    for sample in samples:
        others = [work for node, work in works.items() if node != sample.node]
        mine = works.get(sample.node)
        if mine is None or not others:
            continue  # (a node not training keeps no streak: its next ratios start anew)
        ratio = mine / statistics.median(others)
        ratios[sample.node] = (watch.ratios.get(sample.node, ()) + (ratio,))[-WINDOW:]
        streak = ratios[sample.node]
        if len(streak) < WINDOW:
            continue
        if sample.node not in flagged and min(streak) >= policy.factor:
            flagged.add(sample.node)
            verdicts.append(Verdict("flagged", sample, ratio))
        elif sample.node in flagged and max(streak) < clear_at(policy.factor):
            flagged.discard(sample.node)
            verdicts.append(Verdict("cleared", sample, ratio))
    pending = watch.pending
    if pending is not None and (pending[0] not in {s.node for s in samples} or
                                now >= pending[1] + PENDING_FOR):
        pending = None
    watch = replace(watch, ratios=ratios, flagged=frozenset(flagged), pending=pending)
    if policy.replace and pending is None and spares > 0 and len(samples) - 1 >= policy.min_nodes:
        watch, replaced = _replace_one(watch, samples, now)
        verdicts += replaced
    return watch, verdicts


def _replace_one(watch: Watch, samples: list[Sample], now: float) -> tuple[Watch, list[Verdict]]:
    """Ask the slowest flagged node whose host is not backing off to leave."""
    candidates = [(watch.ratios[s.node][-1], s) for s in samples
                  if s.node in watch.flagged and _may_ask(watch, s.host, now)]
    if not candidates:
        return watch, []
    ratio, sample = max(candidates, key=lambda candidate: candidate[0])
    last = watch.asked.get(sample.host)
    backoff = BACKOFF if last is None else 2 * last[1]
    asked = {**watch.asked, sample.host: (now, backoff)}
    return (replace(watch, asked=asked, pending=(sample.node, now)),
            [Verdict("replaced", sample, ratio)])


def _may_ask(watch: Watch, host: str, now: float) -> bool:
    last = watch.asked.get(host)
    return last is None or now >= last[0] + last[1]
