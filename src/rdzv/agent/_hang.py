"""Hung workers, as rules of the node's protocol (pure; time comes with each call).

A worker that uses the in-process API reports its step every ``PROGRESS_EVERY`` (0.5 s) while it
trains. One that reports nothing for the hang timeout is asked where its training thread is
(:class:`~rdzv._messages.Probe`, answered from another thread of the worker):

* **in its own code** (or no answer within ``PROBE_GRACE``: a thread that holds the interpreter)
  -> it is hung: the executor writes every worker's stacks to the log and the history
  (``worker_hung``) and ends it; its end is then a crash like any other: the others recover
  in-process without it, and it is restarted alone (within ``--max-restarts``) to rejoin warm;
* **waiting in a collective** -> its group waits for another rank, the culprit, whose own agent
  acts; this one says so once and asks again. Only if the wait lasts twice the timeout (nobody
  acted: a wait on something outside the job) is it declared hung too, so nothing waits forever.

The timeout is ``--hang-timeout`` seconds, or by default ``HANG_STEPS`` times the slowest step
the worker reported (its moving average), at least ``HANG_FLOOR``; 0 turns the watch off. Only
workers that have reported a step time are watched (the first steps, compilation or a warm-up,
may take long), and none while its group changes (a transition is bounded by its own timeout).
"""

from __future__ import annotations

import math

from .._messages import Where
from ._moves import say, with_slot
from ._protocol import Node, Phase, Result, Rules, Slot, Worker, act

HANG_FLOOR = 300.0
"""The least default hang timeout, in seconds (a step that saves a large checkpoint may be long:
give ``--hang-timeout`` when steps may take longer)."""
HANG_STEPS = 20
"""The default hang timeout in steps: this many of the slowest step time reported."""
PROBE_GRACE = 1.0
"""Seconds a worker asked where it is has to answer."""
WATCHED = (Phase.FORMING, Phase.SETTLING, Phase.AWAITING, Phase.RUNNING)
QUIET = {"probed": None, "recheck": 0.0, "noted": False}
"""A slot's watch after a sign of progress: no question pending, nothing to ask again."""
"""The node's phases in which its running workers train (a planned change forms meanwhile)."""


def hang_timeout(slot: Slot, rules: Rules) -> float | None:
    """Seconds without progress after which ``slot``'s worker is asked where it is (None: it
    is not watched)."""
    if rules.hang_timeout == 0 or slot.state is not Worker.RUNNING or slot.step_time is None:
        return None
    if rules.hang_timeout is not None:
        return rules.hang_timeout
    return max(HANG_FLOOR, HANG_STEPS * slot.longest)


def _watching(node: Node) -> bool:
    return node.phase in WATCHED and node.leave is None and bool(node.inprocess)


def hang_due(node: Node, rules: Rules) -> float:
    """The next time the watch has something to check (inf: none)."""
    if not _watching(node):
        return math.inf
    due = math.inf
    for slot in node.slots:
        timeout = hang_timeout(slot, rules)
        if timeout is None or slot.hung:
            continue
        due = min(due, slot.probed + PROBE_GRACE if slot.probed is not None else
                  max(slot.sampled + timeout, slot.recheck))
    return due


def check_hangs(node: Node, now: float, rules: Rules) -> Result:
    """On time passing: probe the workers silent for their timeout; declare hung those that did
    not answer a probe."""
    if not _watching(node):
        return node, []
    acts = []
    for lr, slot in enumerate(node.slots):
        timeout = hang_timeout(slot, rules)
        if timeout is None or slot.hung:
            continue
        if slot.probed is not None:
            if now >= slot.probed + PROBE_GRACE:
                node, more = _hung(node, lr, now, f"it did not say where it is within "
                                                  f"{PROBE_GRACE:g} s", "")
                acts += more
        elif now >= max(slot.sampled + timeout, slot.recheck):
            node = with_slot(node, lr, probed=now)
            acts.append(act("probe", lr))
    return node, acts


def on_where(node: Node, lr: int, where: Where, now: float, rules: Rules) -> Result:
    """A probed worker's answer."""
    slot = node.slots[lr]
    timeout = hang_timeout(slot, rules)
    if slot.probed is None or slot.hung or timeout is None or not _watching(node):
        return with_slot(node, lr, probed=None), []
    node = with_slot(node, lr, probed=None)
    silent = now - slot.sampled
    if not where.waiting:
        return _hung(node, lr, now, "its training thread is in its own code", where.frame,
                     where.step)
    if silent >= 2 * timeout:
        return _hung(node, lr, now, f"it waits in a collective for {silent:.0f} s and no other "
                                    "rank was found hung", where.frame, where.step)
    node = with_slot(node, lr, recheck=now + timeout / 2)
    if slot.noted:
        return node, []
    return with_slot(node, lr, noted=True), [say(
        f"local rank {lr} made no progress for {silent:.0f} s after step {where.step}: it waits "
        "in a collective for another rank (that rank's agent acts on it); waiting")]


def _hung(node: Node, lr: int, now: float, why: str, frame: str,
          step: int | None = None) -> Result:
    """Declare ``lr``'s worker hung after completing ``step`` (None: its last report's)."""
    slot = node.slots[lr]
    silent = now - slot.sampled
    group = node.group
    rank = (group.offset + group.local_ranks.index(lr)
            if group is not None and lr in group.local_ranks else None)
    node = with_slot(node, lr, hung=True, probed=None)
    step = slot.step if step is None or step < 0 else step
    return node, [act("hung", lr, rank, step, round(silent, 3), why, frame)]

