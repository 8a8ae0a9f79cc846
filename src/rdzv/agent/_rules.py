"""The rules of a node's protocol: :func:`step`, one event at a time (see ``_protocol.py`` for
the phases, events and actions): the round (formed, settled, decided, entered), the membership,
time; the workers' events are ``_worker_rules.py``. Pure: no I/O, no clock (``now`` comes with
the call)."""

from __future__ import annotations

import math
import signal as signals
from dataclasses import replace
from typing import Any

from ._hang import check_hangs
from ._moves import (
    EXIT_BARRIER_TIMEOUT,
    LOST_AT_START,
    SHOWN,
    TRANSITIONS,
    abandon,
    abort_due,
    aborted,
    aborting,
    bring_in,
    cancel,
    exit_with,
    fail,
    finished,
    join,
    left_out_now,
    outside,
    running,
    say,
    settle,
    settled,
    signalled,
    take_up_leave,
    unshown,
    with_slot,
    without_api,
)
from ._protocol import (
    Abandoned,
    Act,
    AllFinished,
    Assigned,
    Changed,
    Decided,
    Evicted,
    Exited,
    Expired,
    Formed,
    FormFailed,
    FromWorker,
    Group,
    Hinted,
    LeaveFailed,
    NextSeen,
    Node,
    Phase,
    RecordsIn,
    Result,
    Rules,
    Signalled,
    Tick,
    Unreadable,
    Worker,
    act,
)
from ._records import Kind
from ._worker_rules import on_exit, on_leave_failed, on_next, on_worker


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


# -- the round ------------------------------------------------------------------------------
def _on_formed(node: Node, event: Formed, now: float, rules: Rules) -> Result:
    node = without_api(node, now, rules)
    deadline = now + rules.switch_timeout
    if not settled(node, rules):  # workers starting: they connect within the grace, or never
        deadline = (node.started + rules.connect_grace if node.inprocess is None else
                    now + max(rules.switch_timeout, rules.connect_grace))
    node = replace(node, phase=Phase.SETTLING, gen=event.gen, group_rank=event.group_rank,
                   nodes=event.nodes, decision=None, assignment=None, hint=None,
                   hint_written=False, record_final=False, deadline=deadline)
    acts = [act("watch", node.gen)]
    api = node.recorded_api(rules.restart_on_change)
    if node.coordinator and (api is not None or not node.live):
        # (None when no worker runs and none has said whether it uses the API: the newcomers
        # start theirs with the others, and do not take the program for one without the API
        # while they start. Known, or under --restart-on-change: whether they switch.)
        hint = None if node.inprocess is None and not node.live else api
        node = replace(node, hint_written=True)
        acts.append(act("hint", hint))
    finished = any(s.state is Worker.DONE for s in node.slots)
    if not node.live and not node.coordinator and not finished:
        return node, acts + [act("record")]  # a newcomer: it waits for the hint
    return settle(node, acts, rules)


def _on_hinted(node: Node, event: Hinted, now: float, rules: Rules) -> Result:
    if node.phase is not Phase.SETTLING or node.live or node.record_final:
        return node, []
    if node.inprocess is None:  # the job's program is this node's: whether it uses the API
        node = replace(node, inprocess=event.inprocess)
    if event.inprocess and not rules.restart_on_change:
        slots = tuple(replace(s, state=Worker.STARTING, step=None, join=True,
                              batch=node.restarts) for s in node.slots)
        moved, acts = settle(replace(node, slots=slots, inprocess=True, started=now), [], rules)
        return moved, [say("the job runs in-process: starting the workers now; they join it "
                            "once warm"), act("start", True), *acts]
    return settle(node, [], rules)


def _on_records(node: Node, event: RecordsIn, now: float, rules: Rules) -> Result:
    if node.phase not in (Phase.SETTLING, Phase.AWAITING) or node.decision is not None:
        return node, []
    return node, [act("decide", event.records, event.timed_out)]


def _on_decided(node: Node, event: Decided, now: float, rules: Rules) -> Result:
    if node.phase not in (Phase.SETTLING, Phase.AWAITING) or node.decision is not None:
        return node, []
    decision = event.decision
    if decision.kind is Kind.CANCEL:
        return join(node, say(f"round {node.gen} was cancelled ({decision.why}): forming "
                                "the next round"))
    if decision.kind is Kind.FINISH:
        return _finish(replace(node, decision=decision), now)
    node = replace(node, phase=Phase.AWAITING, decision=decision)
    if node.cancelled is not None:  # decided before this node's cancel: the cause still holds
        return abandon(node, f"{node.cancelled}, after the round's decision", now)
    return node, [act("fetch")]


def _finish(node: Node, now: float) -> Result:
    """The job is over (a ``finish`` decision): every node marks itself done and waits for the
    others to end (the run is closed once all are). One that came as the job ended stops the
    workers it started to join first."""
    acts = [act("next", node.decision)] if node.coordinator else []
    if not all(s.state is Worker.DONE for s in node.slots):
        acts = [say("the job finished before this node's workers could join it: nothing to "
                    "do; waiting for the other nodes to end"), act("stop", signals.SIGTERM),
                *acts]
        node = replace(node, slots=tuple(s if s.state is Worker.DONE else
                                         replace(s, state=Worker.GONE) for s in node.slots))
    return finished(node, now, *acts, act("watch", node.gen))


def _ended_without_it(node: Node) -> Result:
    """The run was closed before this node's workers (started to join it) were in its group."""
    return exit_with(node, 0, say("the job finished before this node's workers could join it: "
                                  "stopping them; nothing to do"), act("stop", signals.SIGTERM))


def _on_assigned(node: Node, event: Assigned, now: float, rules: Rules) -> Result:
    decision = node.decision
    if node.phase is not Phase.AWAITING or decision is None:
        return node, []
    mine = event.assignment
    node = replace(node, assignment=mine)
    acts = [act("next", decision)] if node.coordinator else []
    if decision.kind in (Kind.START, Kind.RESTART):
        return _restart(node, acts, now, rules)
    if not mine.local_ranks and not all(s.state is Worker.DONE for s in node.slots):
        acts.append(act("outside"))  # (the job's end does not wait for workers not in it)
    if decision.kind is Kind.STAY:
        return running(node, acts, now, rules)
    if not mine.local_ranks:  # none of this node's workers is in the group
        return running(replace(node, group=None), acts, now, rules)
    if any(node.slots[lr].state is Worker.DONE for lr in mine.local_ranks):
        return abandon(node, "this node's workers finished before they entered the new group",
                       now)
    if decision.kind is Kind.RECOVER:
        node = aborting(node, now)
        acts.append(act("abort"))
    acts.append(act("plans"))
    joining = all(node.slots[lr].state is Worker.FRESH for lr in mine.local_ranks)
    node = replace(node, phase=Phase.ENTERING, entering_since=now, joining=joining)
    return replace(node, deadline=_entering_deadline(node, rules)), acts


def _entering_deadline(node: Node, rules: Rules) -> float:
    """When entering the group times out (``--switch-timeout``), or sooner, when a worker told
    to abort its group that has not shown yet that it left it is due (:func:`abort_due`)."""
    return min([node.entering_since + rules.switch_timeout] +
               [abort_due(node.slots[lr]) for lr in unshown(node)])


def _restart(node: Node, acts: list[Act], now: float, rules: Rules) -> Result:
    """Start the workers (anew) in round ``gen``, counting a restart this node caused."""
    decision = node.decision
    assert decision is not None and node.assignment is not None
    restarts = node.restarts
    if decision.kind is Kind.RESTART:
        if node.restart_why is not None and node.restart_cause != LOST_AT_START:
            if restarts >= rules.max_restarts:
                return fail(node, f"workers failed after {restarts} restart(s) "
                                   f"(--max-restarts {rules.max_restarts})")
            restarts += 1
            acts += [say(f"{node.restart_why}; restarting the workers (restart {restarts} of "
                          f"{rules.max_restarts})"),
                     act("event", "workers_restarted", {"restarts": restarts, "reason":
                                                        node.restart_why})]
        else:
            acts.append(say(f"restarting the workers in the new round: {decision.why}"))
    slots = tuple(replace(s, state=Worker.STARTING, step=None, join=False, batch=None, **SHOWN)
                  for s in node.slots)
    node = replace(node, phase=Phase.RUNNING, slots=slots, restarts=restarts, restart_why=None,
                   restart_cause="", failed_transitions=0, entered_at=None,
                   group=Group(decision.prefix, node.assignment.rank_offset,
                               decision.world_size, node.assignment.local_ranks),
                   deadline=math.inf, started=now)
    acts += [act("stop", signals.SIGTERM), act("start", False), act("watch", node.gen)]
    if node.leave is not None and not node.leave.announced:
        return take_up_leave(node, acts, now, rules)
    return node, acts


# -- the membership ---
def _on_changed(node: Node, event: Changed, now: float, rules: Rules) -> Result:
    phase = node.phase
    if event.closed:
        if phase is Phase.FINISHED:
            return exit_with(node, 0, act("succeed"))
        if phase is Phase.RUNNING and _starting_in_group(node, now, rules):
            return exit_with(node, 1, act("stop", signals.SIGTERM), act(
                "closed", "while this node's workers started in a new group, which cannot "
                          "form without the other nodes"))
        if phase is Phase.RUNNING and outside(node) and not any(
                s.state is Worker.STARTING and not s.join for s in node.slots):
            return _ended_without_it(node)  # (workers started to join it, or none runs)
        if phase is Phase.RUNNING:
            return node, [say("the rendezvous was closed by another node; waiting for this "
                               "node's workers to finish")]
        return node, []
    own = node.leave is not None and node.leave.announced
    gone = event.lost + max(0, event.leaving - own)  # (its own notice is no member gone)
    doomed = gone and _starting_in_group(node, now, rules)
    if doomed:  # (in any phase: they may never connect)
        node = _doomed_start(node)
    if phase is Phase.RUNNING:
        if node.leave is not None and node.leave.announced:
            return node, []  # this node's own announcement
        if doomed:
            return join(node, say(f"{gone} member(s) of the round lost or leaving while this "
                                  "node's workers may still be starting in its group (which "
                                  "cannot form without them): the workers restart in the next "
                                  "round"),
                        *([act("losses")] if event.lost else []))
        if event.lost:  # the round's decision aborts the group if a member of it is lost
            return join(node, say(f"{event.lost} member(s) of the round lost: forming the "
                                  "next round without them; the workers stay up"),
                        act("losses"))
        what = (f"{event.leaving} node(s) leaving" if event.leaving else
                f"{event.waiting} node(s) waiting to join" if event.waiting else
                "the other nodes moved on")
        return join(node, say(f"{what}: forming the next round in the background; the "
                                "workers keep training"))
    if phase is Phase.FINISHED:
        return join(node, say("another node re-forms the job: this node joins it"))
    if phase in (Phase.SETTLING, Phase.AWAITING) and node.decision is None and event.lost:
        return cancel(node, f"{event.lost} participant(s) lost before the decision")
    if phase in (Phase.AWAITING, Phase.ENTERING) and node.decision and event.lost:
        return abandon(node, "a participant of the new group was lost", now)
    if doomed and phase is Phase.SETTLING:  # (a leaver: its record is final now)
        return settle(node, [], rules)
    return node, []  # (a node that abandons the round says so: Abandoned)


def _starting_in_group(node: Node, now: float, rules: Rules) -> bool:
    """Whether workers of this node may still be starting in its group (in
    ``init_process_group``): started with it, not yet connected, and of a program that connects
    once started (or, not known yet, still within the grace to connect)."""
    connects = node.inprocess or (node.inprocess is None and
                                  now < node.started + rules.connect_grace)
    return bool(connects) and any(s.state is Worker.STARTING and not s.join
                                  for s in node.slots)


def _doomed_start(node: Node) -> Node:
    """A member of the round was lost, or is leaving, while this node's workers may still be
    starting in its group (:func:`_starting_in_group`): they wait in ``init_process_group`` for
    all of its members, and a lost one never comes (nor does a leaver's whose workers were
    stopped with it, as Slurm does). The record says so at once (they are broken, and the
    workers restart in the next round, which does not count as a restart of this node's: no
    worker of it failed), instead of leaving the others to wait for them to connect until
    ``--worker-connect-timeout``."""
    why = "the workers were starting in a group that lost a member, or one leaving"
    slots = tuple(replace(s, state=Worker.BROKEN, step=None)
                  if s.state is Worker.STARTING and not s.join else s for s in node.slots)
    return replace(node, slots=slots, restart_why=node.restart_why or why,
                   restart_cause=node.restart_cause or LOST_AT_START)


def _on_abandoned(node: Node, event: Abandoned, now: float, rules: Rules) -> Result:
    if node.phase in (Phase.AWAITING, Phase.ENTERING) and node.decision is not None:
        return abandon(node, "another node could not enter the new group", now)
    return node, []


# -- time, the run --
def _on_expired(node: Node, event: Expired, now: float, rules: Rules) -> Result:
    """The others took this node for gone: it joins the next round (as a new node). Its
    workers still starting wait for a group the others have left: they restart."""
    if node.phase in (Phase.FORMING, Phase.EXITED):
        return node, []
    if _starting_in_group(node, now, rules):
        node = _doomed_start(node)
    if node.phase in (Phase.RUNNING, Phase.FINISHED) and node.leave is None:
        return join(aborted(node, now), say(f"this node's store session expired, so the "
                                               f"others take it for gone ({event.why}); "
                                               "re-forming"), act("abort"))
    if node.phase in TRANSITIONS:
        return join(aborted(node, now), say(f"this node's store session expired as the "
                                               f"round formed, so the others take it for gone "
                                               f"({event.why}); re-forming"), act("abort"))
    return node, []


def _on_tick(node: Node, event: Tick, now: float, rules: Rules) -> Result:
    node, acts = check_hangs(node, now, rules)
    moved, more = _on_time(node, now, rules)
    return moved, acts + more


def _on_time(node: Node, now: float, rules: Rules) -> Result:
    leave = node.leave
    if leave is not None and now >= leave.deadline:
        return exit_with(node, 0, say(f"leaving: the grace period of {rules.leave_grace:g} s ended "
                                   "before the workers left; stopping them"),
                     act("stop", leave.signum))
    if now < node.deadline:
        return node, []
    if node.phase is Phase.RUNNING:
        return bring_in(node, [], now, rules)
    if node.phase is Phase.FINISHED:
        return exit_with(node, 0, say(f"not every node finished within {EXIT_BARRIER_TIMEOUT:g} "
                                   "s; leaving anyway"))
    timeout = f"{rules.switch_timeout:g} s (--switch-timeout)"
    if node.phase is Phase.SETTLING:
        acts = [act("record")]
        if node.coordinator and not node.hint_written:
            acts.insert(0, act("hint", False))
        node = without_api(node, now, rules)
        if not settled(node, rules):
            node = replace(node, restart_cause="connect_timeout",
                           restart_why=f"the workers did not connect to their agent "
                                             f"within {timeout}")
        return replace(node, phase=Phase.AWAITING, record_final=True, hint_written=True,
                       deadline=now + rules.switch_timeout), acts
    if node.phase is Phase.AWAITING and node.decision is None:
        return cancel(replace(node, deadline=now + rules.switch_timeout),
                       f"no decision within {timeout}")
    if node.phase is Phase.AWAITING:
        return abandon(node, f"this node's assignment could not be read within {timeout}",
                       now)
    if node.phase is Phase.ENTERING:
        late = [lr for lr in unshown(node) if now >= abort_due(node.slots[lr])]
        stuck = [lr for lr in late if node.slots[lr].abort_probed is not None]
        if stuck:
            since = min(node.slots[lr].aborted_at or now for lr in stuck)
            return left_out_now(node, stuck, f"no sign of it {now - since:.1f} s after the "
                                "abort", now)
        for lr in late:  # asked where it is
            node = with_slot(node, lr, abort_probed=now)
        acts = [act("probe", lr) for lr in late]
        if now < node.entering_since + rules.switch_timeout:  # (or they all left it)
            return replace(node, deadline=_entering_deadline(node, rules)), acts
        return abandon(node, f"the workers did not enter the new group within {timeout}", now)
    return node, []


def _on_evicted(node: Node, event: Evicted, now: float, rules: Rules) -> Result:
    """Asked to leave for a spare: a graceful leave where one is possible, else it stays."""
    return signalled(node, Signalled(signals.SIGTERM, f"asked to leave ({event.why})"), now,
                     rules)


def _on_unreadable(node: Node, event: Unreadable, now: float, rules: Rules) -> Result:
    """Another node wrote what this one cannot read (another rdzv version, a corrupt store):
    waiting would not help; the run fails with the reason."""
    return fail(node, f"{event.message} (is every node running the same rdzv version?)")


def _on_all_finished(node: Node, event: AllFinished, now: float, rules: Rules) -> Result:
    if node.phase is not Phase.FINISHED:
        return node, []
    return exit_with(node, 0, act("succeed"))


def _on_form_failed(node: Node, event: FormFailed, now: float, rules: Rules) -> Result:
    if event.kind == "graceful":
        return exit_with(node, 0, say(f"asked to leave the run: {event.message}"))
    if event.kind == "spare":
        return exit_with(node, 0, act("spare_done"))
    if event.kind == "closed" and node.phase is Phase.FORMING and any(
            s.state is Worker.RUNNING for s in node.slots):
        return replace(node, phase=Phase.RUNNING), [say(
            "the rendezvous is closed: waiting for this node's workers to finish")]
    if event.kind == "closed" and not node.failures and outside(node) and any(
            s.join and s.state in (Worker.STARTING, Worker.FRESH) for s in node.slots):
        return _ended_without_it(node)  # (its workers were warm as the job ended)
    if event.kind == "closed":
        if node.failures:
            return exit_with(node, 1, act("stop", signals.SIGTERM), act(
                "fail", f"the workers cannot restart: the rendezvous is closed "
                        f"({event.message})"))
        return exit_with(node, 1, act("stop", signals.SIGTERM), act("closed", event.message))
    if event.kind == "store":
        return exit_with(node, 1, act("stop", signals.SIGTERM), act("store_lost"), say(
            f"the rendezvous store cannot be reached any more ({event.message}): the node that "
            "hosted it (is_host) has probably left, taking the store with it, and this node "
            "cannot go on without it; stopping. A store the nodes outlive (`rdzv serve`, etcd) "
            "lets any node leave"))
    return exit_with(node, 1, act("stop", signals.SIGTERM),
                 say(f"rendezvous failed: {event.message}"))


_HANDLERS: dict[type, Any] = {
    Formed: _on_formed, FormFailed: _on_form_failed, Hinted: _on_hinted,
    RecordsIn: _on_records, Decided: _on_decided, Assigned: _on_assigned,
    Abandoned: _on_abandoned, Changed: _on_changed, FromWorker: on_worker, Exited: on_exit,
    Signalled: signalled, Evicted: _on_evicted, Expired: _on_expired, LeaveFailed: on_leave_failed,
    NextSeen: on_next, Tick: _on_tick, AllFinished: _on_all_finished,
    Unreadable: _on_unreadable,
}
