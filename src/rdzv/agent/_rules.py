"""The rules of a node's protocol: :func:`step`, one event at a time (see ``_protocol.py`` for
the phases, events and actions). Pure: no I/O, no clock (``now`` comes with the call)."""

from __future__ import annotations

import math
import signal as signals
from dataclasses import replace
from typing import Any

from .._messages import Broken, Entered, Failed, Hello, Left, Progress, Term
from ._protocol import (
    Abandoned,
    Act,
    AllFinished,
    Assigned,
    Changed,
    Decided,
    Exited,
    Expired,
    FormFailed,
    Formed,
    FromWorker,
    Group,
    Hinted,
    Leave,
    LeaveFailed,
    NextSeen,
    Node,
    Phase,
    RecordsIn,
    Result,
    Rules,
    Signalled,
    Tick,
    Worker,
    act,
)
from ._records import Kind, SlotState

EXIT_BARRIER_TIMEOUT = 300.0
"""Seconds a node whose workers succeeded waits for the other nodes to finish (torch's value)."""
CONNECT_GRACE = 10.0
"""Seconds after their start within which workers that use the in-process API connect to their
agent (Python and torch start-up); workers silent longer do not use it."""
TRANSITIONS = (Phase.SETTLING, Phase.AWAITING, Phase.ENTERING)


def step(node: Node, event: Any, now: float, rules: Rules) -> Result:
    """The node's next state and actions after ``event`` at monotonic time ``now``."""
    if node.phase is Phase.EXITED:
        return node, []
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"not a node event: {event!r}")
    if isinstance(event, Formed):
        if node.phase is not Phase.FORMING or event.gen != node.gen + 1:
            return node, []
    elif getattr(event, "gen", node.gen) != node.gen:
        return node, []  # an event of an earlier round
    return handler(node, event, now, rules)


# -- small helpers ----------------------------------------------------------------------------
def settled(node: Node) -> bool:
    """Whether this node's record can be final: no worker it waits for is still starting."""
    return all(s.report(node.inprocess) is not SlotState.STARTING for s in node.slots)


def _slot(node: Node, local_rank: int, **changes: Any) -> Node:
    slots = list(node.slots)
    slots[local_rank] = replace(slots[local_rank], **changes)
    return replace(node, slots=tuple(slots))


def _say(text: str) -> Act:
    return act("say", text)


def _join(node: Node, *before: Act) -> Result:
    """Leave round ``gen`` for the next one (the workers go on training, or wait broken)."""
    return (replace(node, phase=Phase.FORMING, decision=None, hint=None, hint_written=False,
                    record_final=False, deadline=math.inf), [*before, act("join")])


def _aborted(node: Node) -> Node:
    """The workers' group is being aborted: those in it report broken (at their last step)."""
    return replace(node, slots=tuple(
        replace(s, state=Worker.BROKEN) if s.state in (Worker.RUNNING, Worker.ENTERED) else s
        for s in node.slots))


def _abandon(node: Node, why: str) -> Result:
    """Leave a decided round whose group cannot form: abort the workers' group, mark the round
    abandoned (the others see it at once) and join the next round, as a recovery."""
    return _join(_aborted(node), _say(f"{why}: aborting the workers' group and forming the "
                                      "next round"), act("abort"), act("abandon"))


def _cancel(node: Node, why: str) -> Result:
    """Before the decision: cancel the round (a fenced write; a decision written first wins)."""
    return node, [_say(f"{why}: cancelling this round's transition"), act("cancel")]


def _exit(node: Node, code: int, *before: Act) -> Result:
    return replace(node, phase=Phase.EXITED), [*before, act("exit", code)]


def _fail(node: Node, why: str) -> Result:
    """Give up: the run fails (summary, rendezvous closed), exit 1."""
    return _exit(node, 1, act("stop", signals.SIGTERM), act("fail", why))


def _running(node: Node, acts: list[Act], now: float, rules: Rules) -> Result:
    """The workers run in round ``gen``: take up what waited for the transition's end."""
    node = replace(node, phase=Phase.RUNNING, deadline=math.inf, record_final=False)
    if node.leave is not None and not node.leave.announced:
        moved, more = _on_signal(node, Signalled(node.leave.signum), now, rules, pending=True)
        return moved, acts + more
    if any(s.state is Worker.FRESH for s in node.slots):
        return _join(node, *acts, _say("a restarted worker is warm: bringing it into the group"))
    return node, acts + [act("watch", node.gen)]


def _after_failure(node: Node, why: str, now: float, rules: Rules) -> Result:
    """A worker failed outside the in-process API: every worker restarts in the next round."""
    node = replace(node, restart_why=node.restart_why or why, failures=node.failures + (why,))
    say = _say(f"{why}: the workers restart in the next round")
    if node.phase is Phase.RUNNING:
        return _join(node, say)
    if node.phase is Phase.AWAITING and node.decision is None:
        moved, acts = _cancel(node, why)
        return moved, [say, *acts]
    if node.phase is Phase.ENTERING or (node.phase is Phase.AWAITING and node.decision):
        return _abandon(node, why)
    return node, [say]  # forming or settling: the record says so


# -- the round ------------------------------------------------------------------------------
def _on_formed(node: Node, event: Formed, now: float, rules: Rules) -> Result:
    deadline = now + rules.switch_timeout
    if not settled(node):  # workers starting: they connect within the grace, or never
        deadline = (node.started + CONNECT_GRACE if node.inprocess is None else
                    now + max(rules.switch_timeout, CONNECT_GRACE))
    node = replace(node, phase=Phase.SETTLING, gen=event.gen, group_rank=event.group_rank,
                   nodes=event.nodes, decision=None, assignment=None, hint=None,
                   hint_written=False, record_final=False, deadline=deadline)
    acts = [act("watch", node.gen)]
    if node.coordinator:
        known = node.inprocess if node.inprocess is not None or node.live else False
        if known is not None:
            node = replace(node, hint_written=True)
            acts.append(act("hint", known and not rules.restart_on_change))
    finished = any(s.state is Worker.DONE for s in node.slots)
    if not node.live and not node.coordinator and not finished:
        return node, acts + [act("record")]  # a newcomer: it waits for the hint
    return _settle(node, acts)


def _settle(node: Node, acts: list[Act]) -> Result:
    """Write the record; final (and on to AWAITING) once the workers are settled."""
    if not settled(node):
        return node, acts + [act("record")]
    return replace(node, phase=Phase.AWAITING, record_final=True), acts + [act("record")]


def _on_hinted(node: Node, event: Hinted, now: float, rules: Rules) -> Result:
    if node.phase is not Phase.SETTLING or node.live or node.record_final:
        return node, []
    if node.inprocess is None:  # the job's program is this node's: whether it uses the API
        node = replace(node, inprocess=event.inprocess)
    if event.inprocess and not rules.restart_on_change:
        slots = tuple(replace(s, state=Worker.STARTING, step=None, join=True)
                      for s in node.slots)
        moved, acts = _settle(replace(node, slots=slots, inprocess=True, started=now), [])
        return moved, [_say("the job runs in-process: starting the workers now; they join it "
                            "once warm"), act("start", True), *acts]
    return _settle(node, [])


def _on_records(node: Node, event: RecordsIn, now: float, rules: Rules) -> Result:
    if node.phase not in (Phase.SETTLING, Phase.AWAITING) or node.decision is not None:
        return node, []
    return node, [act("decide", event.records, event.timed_out)]


def _on_decided(node: Node, event: Decided, now: float, rules: Rules) -> Result:
    if node.phase not in (Phase.SETTLING, Phase.AWAITING) or node.decision is not None:
        return node, []
    decision = event.decision
    if decision.kind is Kind.CANCEL:
        return _join(node, _say(f"round {node.gen} was cancelled ({decision.why}): forming "
                                "the next round"))
    return replace(node, phase=Phase.AWAITING, decision=decision), [act("fetch")]


def _on_assigned(node: Node, event: Assigned, now: float, rules: Rules) -> Result:
    decision = node.decision
    if node.phase is not Phase.AWAITING or decision is None:
        return node, []
    mine = event.assignment
    node = replace(node, assignment=mine)
    acts = [act("next")] if node.coordinator else []
    if decision.kind in (Kind.START, Kind.RESTART):
        return _restart(node, acts, now, rules)
    if decision.kind is Kind.STAY:
        return _running(node, acts, now, rules)
    if not mine.local_ranks:  # none of this node's workers is in the group
        return _running(replace(node, group=None), acts, now, rules)
    if decision.kind is Kind.RECOVER:
        acts.append(act("abort"))
    acts.append(act("plans"))
    joining = all(node.slots[lr].state is Worker.FRESH for lr in mine.local_ranks)
    return replace(node, phase=Phase.ENTERING, deadline=now + rules.switch_timeout,
                   entering_since=now, joining=joining), acts


def _restart(node: Node, acts: list[Act], now: float, rules: Rules) -> Result:
    """Start the workers (anew) in round ``gen``, counting a restart this node caused."""
    decision = node.decision
    assert decision is not None and node.assignment is not None
    restarts = node.restarts
    if decision.kind is Kind.RESTART:
        if node.restart_why is not None:
            if restarts >= rules.max_restarts:
                return _fail(node, f"workers failed after {restarts} restart(s) "
                                   f"(--max-restarts {rules.max_restarts})")
            restarts += 1
            acts += [_say(f"{node.restart_why}; restarting the workers (restart {restarts} of "
                          f"{rules.max_restarts})"),
                     act("event", "workers_restarted", {"restarts": restarts, "reason":
                                                        node.restart_why})]
        else:
            acts.append(_say(f"restarting the workers in the new round: {decision.why}"))
    slots = tuple(replace(s, state=Worker.STARTING, step=None, join=False)
                  for s in node.slots)
    node = replace(node, phase=Phase.RUNNING, slots=slots, restarts=restarts, restart_why=None,
                   group=Group(decision.prefix, node.assignment.rank_offset,
                               decision.world_size, node.assignment.local_ranks),
                   deadline=math.inf, started=now)
    return node, acts + [act("stop", signals.SIGTERM), act("start", False),
                         act("watch", node.gen)]


# -- the membership --------------------------------------------------------------------------
def _on_changed(node: Node, event: Changed, now: float, rules: Rules) -> Result:
    phase = node.phase
    if event.closed:
        if phase is Phase.FINISHED:
            return _exit(node, 0, act("succeed"))
        if phase is Phase.RUNNING:
            return node, [_say("the rendezvous was closed by another node; waiting for this "
                               "node's workers to finish")]
        return node, []
    if phase is Phase.RUNNING:
        if node.leave is not None and node.leave.announced:
            return node, []  # this node's own announcement
        if event.lost:
            return _join(_aborted(node), _say(
                f"{event.lost} member(s) of the round lost: aborting the workers' group and "
                "forming the next round without them; the workers stay up"),
                act("abort"), act("losses"))
        what = (f"{event.leaving} node(s) leaving" if event.leaving else
                f"{event.waiting} node(s) waiting to join" if event.waiting else
                "the other nodes moved on")
        return _join(node, _say(f"{what}: forming the next round in the background; the "
                                "workers keep training"))
    if phase is Phase.FINISHED:
        return _join(node, _say("another node re-forms the job: this node joins it"))
    if phase in (Phase.SETTLING, Phase.AWAITING) and node.decision is None and event.lost:
        return _cancel(node, f"{event.lost} participant(s) lost before the decision")
    if phase in (Phase.AWAITING, Phase.ENTERING) and node.decision and (event.lost or
                                                                         event.moved):
        return _abandon(node, "a participant of the new group was lost" if event.lost else
                        "a participant of the new group left it")
    return node, []


def _on_abandoned(node: Node, event: Abandoned, now: float, rules: Rules) -> Result:
    if node.phase in (Phase.AWAITING, Phase.ENTERING) and node.decision is not None:
        return _abandon(node, "another node could not enter the new group")
    return node, []


# -- the workers -----------------------------------------------------------------------------
def _on_worker(node: Node, event: FromWorker, now: float, rules: Rules) -> Result:
    lr, message = event.local_rank, event.message
    if not 0 <= lr < len(node.slots):
        return node, []
    slot = node.slots[lr]
    if isinstance(message, Hello):
        return _on_hello(_slot(replace(node, inprocess=True), lr, state=Worker.FRESH if (
            slot.join or message.fresh) else Worker.RUNNING, step=None), lr, now, rules)
    if isinstance(message, Progress):
        return _slot(node, lr, step=message.step, step_time=message.step_time, sampled=now), []
    if isinstance(message, Broken):
        node = _slot(node, lr, state=Worker.FRESH if message.fresh else Worker.BROKEN,
                     step=None if message.fresh else message.step)
        if node.leave is not None and node.leave.announced:
            return _exit(node, 0, _say("leaving: the workers' group failed while the node was "
                                       "leaving; exiting"), act("stop", signals.SIGTERM))
        if node.phase is Phase.RUNNING:
            return _join(node, _say("a worker's process group failed (a peer is gone): "
                                    "forming the next round; the workers stay up"))
        if node.phase is Phase.ENTERING and message.round == node.gen:
            return _abandon(node, "a worker's new group failed while it entered")
        return node, []  # its old group failed: it enters the planned one at once
    if isinstance(message, Entered):
        return _on_entered(node, lr, message, now, rules)
    if isinstance(message, Left):
        node = _slot(node, lr, state=Worker.LEFT, step=message.step)
        if not node.live:
            return _exit(node, 0, _say(f"leaving: the other nodes formed the next round without "
                                       f"this node; its workers left at step {message.step}; "
                                       "exiting"))
        return node, []
    if isinstance(message, Failed):
        return _after_failure(node, f"a worker cannot follow the plan: {message.error}", now,
                              rules)
    if isinstance(message, Term):
        if node.leave is not None:
            return node, []  # the agent got it too (Slurm signals every process)
        moved, acts = _on_signal(node, Signalled(signals.SIGTERM), now, rules)
        if moved.leave is not None:
            moved = replace(moved, leave=replace(moved.leave, by_worker=True))
        return moved, acts
    return node, []  # Closed: its exit follows


def _on_hello(node: Node, lr: int, now: float, rules: Rules) -> Result:
    acts: list[Act] = []
    if node.coordinator and not node.hint_written and node.phase in TRANSITIONS:
        node = replace(node, hint_written=True)
        acts.append(act("hint", not rules.restart_on_change))
    if node.phase is Phase.SETTLING and not node.record_final:
        return _settle(node, acts)
    if node.phase is Phase.RUNNING and node.slots[lr].state is Worker.FRESH:
        return _join(node, *acts, _say("a restarted worker is warm: bringing it into the "
                                       "group"))
    return node, acts


def _on_entered(node: Node, lr: int, message: Entered, now: float, rules: Rules) -> Result:
    if node.phase is not Phase.ENTERING or message.round != node.gen:
        return node, []
    node = _slot(node, lr, state=Worker.ENTERED, step=message.step, sampled=now)
    mine = node.assignment
    decision = node.decision
    assert mine is not None and decision is not None
    if any(node.slots[r].state is not Worker.ENTERED for r in mine.local_ranks):
        return node, []
    slots = tuple(replace(s, state=Worker.RUNNING) if s.state is Worker.ENTERED else s
                  for s in node.slots)
    node = replace(node, slots=slots, group=Group(decision.prefix, mine.rank_offset,
                                                  decision.world_size, mine.local_ranks))
    pause = (now - node.entering_since) if decision.kind is Kind.RECOVER else None
    return _running(node, [act("adopt", node.joining, pause)], now, rules)


def _on_exit(node: Node, event: Exited, now: float, rules: Rules) -> Result:
    lr = event.local_rank
    if not 0 <= lr < len(node.slots) or node.slots[lr].state in (Worker.DONE, Worker.LEFT,
                                                                  Worker.GONE):
        return node, []
    leaving = node.leave is not None and node.leave.announced
    if event.code == 0:
        node = _slot(node, lr, state=Worker.LEFT if leaving else Worker.DONE)
        if node.live:
            return node, []
        if leaving:
            return _exit(node, 0, _say("leaving: the workers left; exiting"))
        return replace(node, phase=Phase.FINISHED, deadline=now + EXIT_BARRIER_TIMEOUT), [
            _say(f"all {len(node.slots)} worker(s) of this node succeeded; waiting for the "
                 "other nodes to finish"), act("done")]
    node = _slot(node, lr, state=Worker.GONE)
    how = (f"signal {signals.Signals(-event.code).name}" if event.code < 0 and
           -event.code in signals.valid_signals() else f"exit code {event.code}")
    who = f"local rank {lr} ended with {how}" + (f" ({event.error})" if event.error else "")
    if leaving:
        return _exit(node, 0, _say(f"leaving: {who} while the node was leaving; exiting"),
                     act("stop", signals.SIGTERM))
    if node.restarts >= rules.max_restarts:
        return _fail(node, f"workers failed after {node.restarts} restart(s) (--max-restarts "
                           f"{rules.max_restarts})")
    if event.code > 0 or not node.inprocess or rules.restart_on_change:
        return _after_failure(node, who, now, rules)
    restarts = node.restarts + 1
    node = _slot(replace(node, restarts=restarts, failures=node.failures + (who,)), lr,
                 state=Worker.STARTING, step=None, join=True)
    acts = [_say(f"{who}: restarting it alone (restart {restarts} of {rules.max_restarts}); "
                 "it joins once warm"), act("replace", lr),
            act("event", "workers_restarted", {"restarts": restarts, "reason": who,
                                               "alone": True})]
    if node.phase is Phase.RUNNING:
        return _join(node, *acts)
    if node.phase is Phase.AWAITING and node.decision is None:
        moved, more = _cancel(node, "a worker crashed after this node's record")
        return moved, acts + more
    if node.phase is Phase.ENTERING or (node.phase is Phase.AWAITING and node.decision):
        moved, more = _abandon(node, "a worker crashed while the group formed")
        return moved, acts + more
    if node.phase is Phase.SETTLING:
        moved, more = _settle(node, [])
        return moved, acts + more
    return node, acts


# -- leaving, signals, time ------------------------------------------------------------------
def _stop_now(node: Node, signum: int, why: str) -> Result:
    name = signals.Signals(signum).name
    if why:
        text = f"{name} received{why}; stopping now"
    elif node.phase is Phase.FORMING and not node.live:
        text = f"{name} received while waiting for nodes: leaving the rendezvous"
    else:
        text = f"{name} received: stopping the workers and leaving the rendezvous"
    return _exit(node, 128 + signum, _say(text), act("stop", signum))


def _on_signal(node: Node, event: Signalled, now: float, rules: Rules,
               pending: bool = False) -> Result:
    signum = event.signum
    if node.leave is not None and node.leave.by_worker and not pending and \
            signum == node.leave.signum:
        return replace(node, leave=replace(node.leave, by_worker=False)), []  # the same notice
    if (node.leave is not None and not pending) or signum == signals.SIGHUP:
        return _stop_now(node, signum, "")
    if node.phase is Phase.FINISHED or not node.live:
        return _stop_now(node, signum, "")
    if node.phase is not Phase.RUNNING:  # leave once the transition is over
        return replace(node, leave=Leave(signum, now + rules.leave_grace)), [_say(
            f"{signals.Signals(signum).name} received during a transition: this node leaves "
            "once it is over")]
    if node.nodes < 2:
        return _stop_now(node, signum, " (this node is alone in its round)")
    if node.nodes - 1 < rules.min_nodes:
        return _stop_now(node, signum, f": the other nodes cannot go on without this one (min "
                                       f"nodes {rules.min_nodes})")
    if rules.hosts_store:
        return _stop_now(node, signum, ": this node serves the rendezvous store, which the "
                                       "others need: it cannot leave gracefully (run `rdzv "
                                       "serve` apart)")
    deadline = node.leave.deadline if node.leave is not None else now + rules.leave_grace
    name = signals.Signals(signum).name
    return replace(node, leave=Leave(signum, deadline, announced=True)), [
        _say(f"{name} received: leaving the job (grace {rules.leave_grace:g} s); the other "
             f"nodes form the next round without this node while its workers keep training "
             f"({name} again stops it at once)"), act("announce")]


def _on_expired(node: Node, event: Expired, now: float, rules: Rules) -> Result:
    """The others took this node for gone: it joins the next round (as a new node)."""
    if node.phase in (Phase.FORMING, Phase.EXITED):
        return node, []
    if node.phase in (Phase.RUNNING, Phase.FINISHED) and node.leave is None:
        return _join(_aborted(node), _say(f"this node's store session expired, so the others "
                                          f"take it for gone ({event.why}); re-forming"),
                     act("abort"))
    if node.phase in TRANSITIONS:
        return _join(_aborted(node), _say(f"this node's store session expired as the round "
                                          f"formed, so the others take it for gone "
                                          f"({event.why}); re-forming"), act("abort"))
    return node, []


def _on_leave_failed(node: Node, event: LeaveFailed, now: float, rules: Rules) -> Result:
    signum = node.leave.signum if node.leave is not None else signals.SIGTERM
    return _stop_now(node, signum, f", but {event.why}")


def _on_next(node: Node, event: NextSeen, now: float, rules: Rules) -> Result:
    if node.leave is None or not node.leave.announced:
        return node, []
    decision = event.decision
    if decision is None:
        return _exit(node, 0, _say("leaving: the grace period ended before the workers left; "
                                   "stopping them"), act("stop", node.leave.signum))
    if decision.kind is Kind.SWITCH and decision.step is not None and node.inprocess:
        return replace(node, leave=replace(node.leave, step=decision.step)), [
            _say(f"leaving: the other nodes formed the next round without this node; its "
                 f"workers stop at step {decision.step}"), act("leave_plans", decision.step)]
    return _exit(node, 0, _say("leaving: the other nodes formed the next round without this "
                               "node; exiting"), act("stop", node.leave.signum))


def _on_tick(node: Node, event: Tick, now: float, rules: Rules) -> Result:
    leave = node.leave
    if leave is not None and now >= leave.deadline:
        return _exit(node, 0, _say(f"leaving: the grace period of {rules.leave_grace:g} s ended "
                                   "before the workers left; stopping them"),
                     act("stop", leave.signum))
    if now < node.deadline:
        return node, []
    if node.phase is Phase.FINISHED:
        return _exit(node, 0, _say(f"not every node finished within {EXIT_BARRIER_TIMEOUT:g} "
                                   "s; leaving anyway"))
    timeout = f"{rules.switch_timeout:g} s (--switch-timeout)"
    if node.phase is Phase.SETTLING:
        acts = [act("record")]
        if node.coordinator and not node.hint_written:
            acts.insert(0, act("hint", False))
        if node.inprocess is None and node.live:  # workers that never connect do not use the API
            node = replace(node, inprocess=False)
        elif not settled(node):
            node = replace(node, restart_why=f"the workers did not connect to their agent "
                                             f"within {timeout}")
        return replace(node, phase=Phase.AWAITING, record_final=True, hint_written=True,
                       deadline=now + rules.switch_timeout), acts
    if node.phase is Phase.AWAITING and node.decision is None:
        return _cancel(replace(node, deadline=now + rules.switch_timeout),
                       f"no decision within {timeout}")
    if node.phase is Phase.AWAITING:
        return _abandon(node, f"this node's assignment could not be read within {timeout}")
    if node.phase is Phase.ENTERING:
        node = replace(node, restart_why=f"the workers did not enter the new group within "
                                         f"{timeout}")
        return _abandon(node, node.restart_why or "")
    return node, []


def _on_all_finished(node: Node, event: AllFinished, now: float, rules: Rules) -> Result:
    if node.phase is not Phase.FINISHED:
        return node, []
    return _exit(node, 0, act("succeed"))


def _on_form_failed(node: Node, event: FormFailed, now: float, rules: Rules) -> Result:
    if event.kind == "graceful":
        return _exit(node, 0, _say(f"asked to leave the run: {event.message}"))
    if event.kind == "spare":
        return _exit(node, 0, act("spare_done"))
    if event.kind == "closed" and node.phase is Phase.FORMING and any(
            s.state is Worker.RUNNING for s in node.slots):
        return replace(node, phase=Phase.RUNNING), [_say(
            "the rendezvous is closed: waiting for this node's workers to finish")]
    if event.kind == "closed":
        if node.failures:
            return _exit(node, 1, act("stop", signals.SIGTERM), act(
                "fail", f"the workers cannot restart: the rendezvous is closed "
                        f"({event.message})"))
        return _exit(node, 1, act("stop", signals.SIGTERM), act("closed", event.message))
    return _exit(node, 1, act("stop", signals.SIGTERM),
                 _say(f"rendezvous failed: {event.message}"))


_HANDLERS: dict[type, Any] = {
    Formed: _on_formed, FormFailed: _on_form_failed, Hinted: _on_hinted,
    RecordsIn: _on_records, Decided: _on_decided, Assigned: _on_assigned,
    Abandoned: _on_abandoned, Changed: _on_changed, FromWorker: _on_worker, Exited: _on_exit,
    Signalled: _on_signal, Expired: _on_expired, LeaveFailed: _on_leave_failed,
    NextSeen: _on_next, Tick: _on_tick, AllFinished: _on_all_finished,
}
