"""The moves the rules of a node's protocol share (``_rules.py``, ``_worker_rules.py``): leave a
round for the next (join, cancel before its decision, abandon after it), exit, fail, settle the
record, run again, and the rules of a leave. Pure, as the rules."""

from __future__ import annotations

import math
import signal as signals
from dataclasses import replace
from typing import Any

from ._protocol import (
    Act,
    Leave,
    Node,
    Phase,
    Result,
    Rules,
    Signalled,
    Slot,
    Worker,
    act,
)
from ._records import SlotState

MAX_FAILED_TRANSITIONS = 3
"""Transitions in a row that could not complete, or whose group failed before a step in it,
before the workers restart instead (a worker that fails every group it enters, a deterministic
error taken for a lost peer)."""
ABORT_CONFIRM = 1.5
"""Seconds a worker has, at least, to show that it left the group its agent aborted (see
:func:`abort_bound`): half its own watch's grace (``rdzv.torch._group.ABORT_GRACE``)."""
ABORT_PROBE = 0.3
"""Seconds after the abort at which a worker that has not shown yet that it left the group is
asked where it is (and, at least, for its answer): one blocked since the abort in a collective
call, or in the gradients' reduction with no gradient since, is stuck in the aborted group's
(a collective call on an aborted group fails at once; DDP's reduction by the end of the
backward pass), and is left out at once."""
EXIT_BARRIER_TIMEOUT = 300.0
"""Seconds a node whose workers succeeded waits for the other nodes to finish (torch's value)."""
TRANSITIONS = (Phase.SETTLING, Phase.AWAITING, Phase.ENTERING)
LOST_AT_START = "lost_at_start"
"""The restart cause of workers that started in a group which lost a member (``_rules``'
``_doomed_start``): no worker of the node failed, so neither the restart nor those workers'
own exit counts against ``--max-restarts``."""


def settled(node: Node, rules: Rules) -> bool:
    """Whether this node's record can be final: no worker it waits for is still starting."""
    api = node.recorded_api(rules.restart_on_change)
    return all(s.report(api) is not SlotState.STARTING for s in node.slots)


def with_slot(node: Node, local_rank: int, **changes: Any) -> Node:
    slots = list(node.slots)
    slots[local_rank] = replace(slots[local_rank], **changes)
    return replace(node, slots=tuple(slots))


def say(text: str) -> Act:
    return act("say", text)


def join(node: Node, *before: Act) -> Result:
    """Leave round ``gen`` for the next one (the workers go on training, or wait broken)."""
    return (replace(node, phase=Phase.FORMING, decision=None, hint=None, hint_written=False,
                    record_final=False, deadline=math.inf, cancelled=None),
            [*before, act("join")])


SHOWN: dict[str, Any] = {"aborted_at": None, "abort_probed": None, "stuck": False}
"""A slot's abort fields once its worker showed that it left the aborted group."""


def aborting(node: Node, now: float) -> Node:
    """The workers in the group are told to abort it at ``now``: each has its
    :func:`abort_bound` to show that it left it."""
    return replace(node, slots=tuple(
        replace(s, aborted_at=now if s.aborted_at is None else s.aborted_at)
        if s.state in (Worker.RUNNING, Worker.ENTERED) else s for s in node.slots))


def aborted(node: Node, now: float) -> Node:
    """The workers' group is being aborted: those in it report broken (at their last step)."""
    return replace(node, slots=tuple(
        replace(s, state=Worker.BROKEN) if s.state in (Worker.RUNNING, Worker.ENTERED) else s
        for s in aborting(node, now).slots))


def abort_bound(slot: Slot) -> float:
    """Seconds worker ``slot`` has to show that it left an aborted group: three of its slowest
    steps, at least :data:`ABORT_CONFIRM`. (Its own abort watch waits three steps, at least
    3 s, before it ends itself; until then a worker stuck in the aborted group's collective
    would hold up every new group it is counted in. Left out, it costs the others a round.)"""
    return max(ABORT_CONFIRM, 3 * slot.longest)


def unshown(node: Node) -> list[int]:
    """The local ranks, in the group being entered, of the workers told to abort their old
    group that have not shown yet that they left it (none for a sharded model: a worker holds
    a part that its node's others lack, so a stuck one ends and they all restart)."""
    mine = node.assignment
    if node.sharded or mine is None:
        return []
    return [lr for lr in mine.local_ranks if node.slots[lr].aborted_at is not None]


def abort_due(slot: Slot) -> float:
    """When an unshown worker is next due: asked where it is (:data:`ABORT_PROBE` after the
    abort), then left out (its :func:`abort_bound` after the abort, and ``ABORT_PROBE`` after
    it was asked at least)."""
    assert slot.aborted_at is not None
    if slot.abort_probed is None:
        return slot.aborted_at + ABORT_PROBE
    return max(slot.aborted_at + abort_bound(slot), slot.abort_probed + ABORT_PROBE)


def left_out_now(node: Node, stuck: list[int], why: str, now: float) -> Result:
    """Leave ``stuck`` out of the group being entered: abandon the round; the next record
    reports them absent."""
    slots = tuple(replace(s, stuck=True) if lr in stuck else s for lr, s in enumerate(node.slots))
    ranks = ", ".join(map(str, stuck))
    return abandon(replace(node, slots=slots), f"local rank(s) {ranks} did not leave the "
                   f"aborted group ({why}; gloo can wait on a closed peer): the next group "
                   "forms without them until they do", now)


def abandon(node: Node, why: str, now: float) -> Result:
    """Leave a decided round whose group cannot form: abort the workers' group, mark the round
    abandoned (the others see it at once) and join the next round, as a recovery. Transitions
    that keep failing end in a restart of every worker (counted)."""
    node = failed_transition(aborted(node, now), f"could not complete (the last: {why})")
    return join(node, say(f"{why}: aborting the workers' group and forming the next round"),
                act("abort"), act("abandon"))


def failed_transition(node: Node, how: str) -> Node:
    """Count a transition that failed (abandoned, or its group failed before a step in it):
    past :data:`MAX_FAILED_TRANSITIONS` in a row the workers restart instead."""
    failed = node.failed_transitions + 1
    node = replace(node, failed_transitions=failed)
    if failed >= MAX_FAILED_TRANSITIONS and node.restart_why is None:
        node = replace(node, restart_cause="transition_failed",
                       restart_why=f"{failed} transitions in a row {how}")
    return node


def group_failed(node: Node, step: int) -> Node:
    """A worker's group failed at ``step`` while the workers trained in it: a group that failed
    before a step in it (``entered_at``) counts as a failed transition (a worker whose every
    group fails at once: a deterministic error taken for a lost peer, which would otherwise
    recover again and again at one step); one they trained in resets the count."""
    if node.entered_at is None or step > node.entered_at:
        return replace(node, failed_transitions=0)
    return failed_transition(node, f"failed at step {step}, where their group was entered, "
                                   "before a step in it")


def cancel(node: Node, why: str) -> Result:
    """Before the decision: cancel the round (a fenced write; a decision written first wins,
    and the node then abandons the round: see ``cancelled``)."""
    return replace(node, cancelled=why), [say(f"{why}: cancelling this round's transition"),
                                          act("cancel")]


def exit_with(node: Node, code: int, *before: Act) -> Result:
    return replace(node, phase=Phase.EXITED), [*before, act("exit", code)]


def finished(node: Node, now: float, *before: Act) -> Result:
    """Nothing left to run on this node: mark it done and wait for the other nodes to end."""
    return replace(node, phase=Phase.FINISHED, deadline=now + EXIT_BARRIER_TIMEOUT), [
        *before, act("done")]


BACK_IN = "a worker left out of the group has left the aborted one: bringing it back in"


def left_out(node: Node) -> list[int]:
    """Workers that hold their state outside the node's group: left out of it as stuck in an
    aborted group (:func:`left_out_now`), they reported since that they left that one."""
    inside = node.group.local_ranks if node.group is not None else ()
    return [lr for lr, s in enumerate(node.slots)
            if s.state is Worker.BROKEN and not s.stuck and lr not in inside]


def outside(node: Node) -> bool:
    """Whether none of this node's workers is in the job's group or finished it: they start to
    join it (or none runs)."""
    return not any(s.state in (Worker.RUNNING, Worker.ENTERED, Worker.BROKEN, Worker.DONE)
                   for s in node.slots)


def fail(node: Node, why: str) -> Result:
    """Give up: the run fails (summary, rendezvous closed), exit 1."""
    return exit_with(node, 1, act("stop", signals.SIGTERM), act("fail", why))


def running(node: Node, acts: list[Act], now: float, rules: Rules) -> Result:
    """The workers run in round ``gen``: take up what waited for the transition's end."""
    node = replace(node, phase=Phase.RUNNING, deadline=math.inf, record_final=False)
    if node.leave is not None and not node.leave.announced:
        return take_up_leave(node, acts, now, rules)
    if left_out(node):  # it showed while the round formed without it
        return join(node, *acts, say(BACK_IN))
    if any(s.state is Worker.FRESH for s in node.slots):
        moved, acts = bring_in(node, acts, now, rules)
        if moved.phase is Phase.RUNNING:  # they wait for a worker still starting: watch on
            acts = [*acts, act("watch", node.gen)]
        return moved, acts
    if not node.live and any(s.state is Worker.DONE for s in node.slots):  # it had finished
        return finished(node, now, *acts, act("watch", node.gen))
    return node, acts + [act("watch", node.gen)]


def take_up_leave(node: Node, acts: list[Act], now: float, rules: Rules) -> Result:
    """The workers run (again) in round ``gen``: the leave asked during the transition now."""
    assert node.leave is not None
    moved, more = signalled(node, Signalled(node.leave.signum, node.leave.notice), now, rules,
                            pending=True)
    return moved, acts + more


def bring_in(node: Node, acts: list[Act], now: float, rules: Rules) -> Result:
    """Bring this node's warm workers started to join (FRESH) into the group, all at once (one
    switch): once none of them is still starting, or the connect grace after the first of them
    turned warm (a start-up slowed by a loaded machine slows its peers' as much: a node whose
    workers come in one by one costs the job a switch for each)."""
    warm = [s.sampled for s in node.slots if s.state is Worker.FRESH]
    if not warm:
        return replace(node, deadline=math.inf), acts
    wait_until = max(node.started, min(warm)) + rules.connect_grace
    if any(s.state is Worker.ENDING for s in node.slots) or (now < wait_until and any(
            s.state is Worker.STARTING and s.join for s in node.slots)):
        return replace(node, deadline=wait_until), acts
    return join(node, *acts, say("workers started to join are warm: bringing them into the "
                                 "group"))


def after_failure(node: Node, why: str, now: float, rules: Rules) -> Result:
    """A worker failed outside the in-process API: every worker restarts in the next round."""
    node = replace(node, restart_why=node.restart_why or why, failures=node.failures + (why,),
                   restart_cause=node.restart_cause or "worker_failed")
    told = say(f"{why}: the workers restart in the next round")
    if node.phase is Phase.RUNNING:
        return join(node, told)
    if node.phase is Phase.AWAITING and node.decision is None and not rules.restart_on_change:
        moved, acts = cancel(node, why)  # (under --restart-on-change the round restarts anyway)
        return moved, [told, *acts]
    if node.phase is Phase.ENTERING or (node.phase is Phase.AWAITING and node.decision):
        return abandon(node, why, now)
    return node, [told]  # forming or settling: the record says so


def without_api(node: Node, now: float, rules: Rules) -> Node:
    """The node once its running workers have had ``--worker-connect-timeout`` to connect to
    their agent: if none did, they do not use the in-process API."""
    if node.inprocess is None and node.live and now >= node.started + rules.connect_grace:
        return replace(node, inprocess=False)
    return node


def settle(node: Node, acts: list[Act], rules: Rules) -> Result:
    """Write the record; final (and on to AWAITING) once the workers are settled."""
    if not settled(node, rules):
        return node, acts + [act("record")]
    return replace(node, phase=Phase.AWAITING, record_final=True), acts + [act("record")]


def stop_now(node: Node, signum: int, why: str) -> Result:
    name = signals.Signals(signum).name
    if why:
        text = f"{name} received{why}; stopping now"
    elif node.phase is Phase.FORMING and not node.live:
        text = f"{name} received while waiting for nodes: leaving the rendezvous"
    else:
        text = f"{name} received: stopping the workers and leaving the rendezvous"
    return exit_with(node, 128 + signum, say(text), act("stop", signum))


def cannot_leave(node: Node, rules: Rules) -> str | None:
    """Why this running node cannot leave gracefully (None: it can), as the tail of a line."""
    if node.nodes < 2:
        return " (this node is alone in its round)"
    if node.nodes - 1 < rules.min_nodes:
        return (f": the other nodes cannot go on without this one (min nodes "
                f"{rules.min_nodes})")
    if rules.hosts_store:
        return (": this node serves the rendezvous store (is_host), which the others need: "
                "they stop too once it is gone (run `rdzv serve` apart, or etcd, for nodes "
                "that can leave)")
    return None


def signalled(node: Node, event: Signalled, now: float, rules: Rules,
              pending: bool = False) -> Result:
    """Asked to leave: by a signal, or (``event.notice``) by group rank 0 for a spare, which
    is never a reason to stop at once: a node that cannot leave gracefully then stays."""
    signum, notice = event.signum, event.notice
    if node.leave is not None and node.leave.by_worker and not pending and \
            signum == node.leave.signum:
        return replace(node, leave=replace(node.leave, by_worker=False)), []  # the same notice
    done = node.phase is Phase.FINISHED or not node.live
    if notice and ((node.leave is not None and not pending) or done):
        return node, [say(f"{notice}, but this node is already leaving or done")]
    if (node.leave is not None and not pending) or signum == signals.SIGHUP or done:
        return stop_now(node, signum, "")
    if rules.hosts_store and not notice and node.nodes > 1:  # (the others need it, at once)
        return stop_now(node, signum, cannot_leave(node, rules) or "")
    name = signals.Signals(signum).name
    if node.phase is not Phase.RUNNING:  # leave once the transition is over
        return replace(node, leave=Leave(signum, now + rules.leave_grace, notice=notice)), [
            say(f"{notice or name + ' received'} during a transition: this node leaves once "
                "it is over")]
    why = cannot_leave(node, rules)
    if why is not None and notice:
        return replace(node, leave=None), [say(f"{notice}, but it stays{why}")]
    if why is not None:
        return stop_now(node, signum, why)
    deadline = node.leave.deadline if node.leave is not None else now + rules.leave_grace
    again = f"{name} stops it at once" if notice else f"{name} again stops it at once"
    return replace(node, leave=Leave(signum, deadline, announced=True)), [
        say(f"{notice or name + ' received'}: leaving the job (grace {rules.leave_grace:g} s); "
            "the other nodes form the next round without this node while its workers keep "
            f"training ({again})"), act("announce")]
