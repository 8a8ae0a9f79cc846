"""The rules of what a node's workers do (``_protocol.py``): what they say on the channel,
their exits (a crash restarts the worker alone; an error restarts every worker, the only
fallback), and the end of a graceful leave. Pure, as every rule."""

from __future__ import annotations

import signal as signals
from dataclasses import replace

from .._messages import (
    Broken,
    Entered,
    Failed,
    Hello,
    Left,
    Moving,
    Progress,
    Shards,
    Term,
    Where,
)
from ._hang import QUIET, on_where
from ._moves import (
    BACK_IN,
    LOST_AT_START,
    SHOWN,
    TRANSITIONS,
    abandon,
    after_failure,
    bring_in,
    cancel,
    exit_with,
    fail,
    finished,
    group_failed,
    join,
    left_out_now,
    running,
    say,
    settle,
    signalled,
    stop_now,
    unshown,
    with_slot,
)
from ._protocol import (
    Act,
    Exited,
    FromWorker,
    Group,
    LeaveFailed,
    NextSeen,
    Node,
    Phase,
    Result,
    Rules,
    Signalled,
    Slot,
    Worker,
    act,
)
from ._records import Kind


def on_worker(node: Node, event: FromWorker, now: float, rules: Rules) -> Result:
    lr, message = event.local_rank, event.message
    if not 0 <= lr < len(node.slots):
        return node, []
    slot = node.slots[lr]
    if slot.state is Worker.ENDING:  # its agent ends it: what it says now is no news
        return node, []
    if isinstance(message, Hello):  # a new process: nothing of the slot's last one holds
        node = replace(node, inprocess=True)
        slots = list(node.slots)
        slots[lr] = Slot(state=Worker.FRESH if slot.join or message.fresh else Worker.RUNNING,
                         sampled=now, join=slot.join, batch=slot.batch)
        return on_hello(replace(node, slots=tuple(slots)), lr, now, rules)
    if isinstance(message, Progress):
        step_time = message.step_time
        longest = max(slot.longest, step_time) if step_time is not None else slot.longest
        if node.failed_transitions and node.entered_at is not None and \
                message.step > node.entered_at:  # a step done in the group
            node = replace(node, failed_transitions=0)
        return with_slot(node, lr, step=message.step, step_time=step_time, longest=longest,
                         compute=message.compute, wait=message.wait, sampled=now, **QUIET), []
    if isinstance(message, Where):
        if slot.probed is not None or not (node.phase is Phase.ENTERING and
                                           slot.abort_probed is not None and lr in unshown(node)):
            return on_where(node, lr, message, now, rules)  # (a hang probe's answer first)
        if not message.stuck:  # it computes: its next collective fails, or it takes its plan
            return node, []
        return left_out_now(node, [lr], "blocked in a collective since the abort, "
                            f"{now - (slot.aborted_at or now):.1f} s ago", now)
    if isinstance(message, Broken):
        node = with_slot(node, lr, state=Worker.FRESH if message.fresh else Worker.BROKEN,
                         step=None if message.fresh else message.step, **SHOWN, **QUIET)
        if node.leave is not None and node.leave.announced:
            return exit_with(node, 0, say("leaving: the workers' group failed while the node was "
                                       "leaving; exiting"), act("stop", signals.SIGTERM))
        if node.phase is Phase.RUNNING and slot.stuck:  # (not the group's failure)
            return join(node, say(BACK_IN))
        if node.phase is Phase.RUNNING:
            if not message.fresh:
                node = group_failed(node, message.step)
            return join(node, say("a worker's process group failed (a peer is gone): "
                                    "forming the next round; the workers stay up"))
        if node.phase is Phase.ENTERING and message.round == node.gen:
            return abandon(node, "a worker's new group failed while it entered", now)
        return node, []  # its old group failed: it enters the planned one at once
    if isinstance(message, Moving):  # out of its old group: not stuck in an aborted one
        if node.phase is Phase.ENTERING and message.round == node.gen:
            node = with_slot(node, lr, **SHOWN)
        return node, []
    if isinstance(message, Entered):
        return on_entered(node, lr, message, now, rules)
    if isinstance(message, Left):
        node = with_slot(node, lr, state=Worker.LEFT, step=message.step)
        if not node.live:
            return exit_with(node, 0, say(f"leaving: the other nodes formed the next round without "
                                       f"this node; its workers left at step {message.step}; "
                                       "exiting"), act("let_go"))
        return node, []
    if isinstance(message, Failed):
        if message.misfit and slot.state is Worker.FRESH:  # (it never held the job's state)
            return misfit(node, lr, message.error, rules)
        return after_failure(node, f"a worker cannot follow the plan: {message.error}", now,
                              rules)
    if isinstance(message, Shards):
        return replace(node, sharded=True), []
    if isinstance(message, Term):
        return worker_notice(node, signals.SIGTERM, now, rules)
    return node, []  # Closed: its exit follows


def misfit(node: Node, lr: int, error: str, rules: Rules) -> Result:
    """A worker started without state (a newcomer, a crashed worker restarted) cannot take the
    job's state: this node runs another program than the job's (another model, a stale image).
    Restarting would not change that: the node leaves with an error, and the job goes on
    without it (the others lose a member; no restart anywhere, the rendezvous stays open).
    Unless the node serves the store, which the others cannot do without: the run fails."""
    why = (f"local rank {lr} cannot take the job's training state ({error}): this node runs "
           "another program than the job's nodes (another model or optimizer, another "
           "version?)")
    refused = act("event", "node_refused", {"local_rank": lr,
                                            "error": error.strip().partition("\n")[0][:200]})
    if rules.hosts_store and node.nodes > 1:
        moved, acts = fail(node, f"{why}; it serves the rendezvous store (is_host), without "
                                 "which the others cannot go on")
        return moved, [refused, *acts]
    return exit_with(node, 1, refused, act("stop", signals.SIGTERM),
                     say(f"{why}; it leaves the job, which goes on without it"))


def worker_notice(node: Node, signum: int, now: float, rules: Rules, *before: Act) -> Result:
    """A worker heard the node's notice to leave (Slurm signals every process of a node): the
    same as the agent's own signal, which then changes nothing."""
    if node.leave is not None:
        return node, []  # the agent got it too
    moved, acts = signalled(node, Signalled(signum), now, rules)
    if moved.leave is not None:
        moved = replace(moved, leave=replace(moved.leave, by_worker=True))
    return moved, [*before, *acts]


def on_hello(node: Node, lr: int, now: float, rules: Rules) -> Result:
    acts: list[Act] = []
    if node.coordinator and not node.hint_written and node.phase in TRANSITIONS:
        node = replace(node, hint_written=True)
        acts.append(act("hint", node.recorded_api(rules.restart_on_change)))
    if node.phase is Phase.SETTLING and not node.record_final:
        return settle(node, acts, rules)
    if node.phase is Phase.RUNNING and node.slots[lr].state is Worker.FRESH:
        return bring_in(node, acts, now, rules)
    return node, acts


def on_entered(node: Node, lr: int, message: Entered, now: float, rules: Rules) -> Result:
    if node.phase is not Phase.ENTERING or message.round != node.gen:
        return node, []
    node = with_slot(node, lr, state=Worker.ENTERED, step=message.step, sampled=now,
                     **SHOWN, **QUIET)
    mine = node.assignment
    decision = node.decision
    assert mine is not None and decision is not None
    if any(node.slots[r].state is not Worker.ENTERED for r in mine.local_ranks):
        return node, []
    slots = tuple(replace(s, state=Worker.RUNNING) if s.state is Worker.ENTERED else s
                  for s in node.slots)
    node = replace(node, slots=slots, entered_at=message.step,
                   group=Group(decision.prefix, mine.rank_offset, decision.world_size,
                               mine.local_ranks))
    pause = (now - node.entering_since) if decision.kind is Kind.RECOVER else None
    # (the decision goes with the action: running() may join the next round at once)
    return running(node, [act("adopt", decision, mine, node.joining, pause)], now, rules)


def on_exit(node: Node, event: Exited, now: float, rules: Rules) -> Result:
    lr = event.local_rank
    if not 0 <= lr < len(node.slots) or node.slots[lr].state in (Worker.DONE, Worker.LEFT,
                                                                  Worker.GONE):
        return node, []
    crashed = node.slots[lr]
    node = with_slot(node, lr, **SHOWN)  # (nothing of it is in a group)
    set_up_with = crashed.batch if crashed.join and crashed.state in (Worker.STARTING,
                                                                      Worker.FRESH) else None
    # (started to join with its node's others, not in yet: they set up in one group)
    if crashed.state is Worker.ENDING and event.code != 0:  # (to start with the others)
        node = with_slot(node, lr, state=Worker.STARTING, join=True, batch=batch(node, lr))
        return node, [act("replace", lr, node.slots[lr].batch)]
    leaving = node.leave is not None and node.leave.announced
    if event.code == 0:
        node = with_slot(node, lr, state=Worker.LEFT if leaving else Worker.DONE)
        if node.live:
            return node, []
        if leaving:
            return exit_with(node, 0, say("leaving: the workers left; exiting"))
        if node.phase is Phase.SETTLING:  # the round being formed tells: a restart (another
            return settle(node, [], rules)  # node's failure) starts them anew; else finished
        if node.phase in (Phase.FORMING, Phase.AWAITING):
            return node, []
        return finished(node, now, say(f"all {len(node.slots)} worker(s) of this node "
                                       "succeeded; waiting for the other nodes to finish"))
    node = with_slot(node, lr, state=Worker.GONE)
    how = (f"signal {signals.Signals(-event.code).name}" if event.code < 0 and
           -event.code in signals.valid_signals() else f"exit code {event.code}")
    who = f"local rank {lr} ended with {how}" + (f" ({event.error})" if event.error else "")
    if leaving:
        return exit_with(node, 0, say(f"leaving: {who} while the node was leaving; exiting"),
                     act("stop", signals.SIGTERM))
    stuck = crashed.stuck  # (left out of the group: its end changes no round)
    doomed = crashed.state is Worker.BROKEN and node.restart_cause == LOST_AT_START
    if (doomed or (crashed.state is Worker.STARTING and node.inprocess is not False)) and \
            -event.code in (signals.SIGTERM, signals.SIGINT):
        # (a worker takes the signal as its node's notice once connected; killed by it before,
        # it is no crash: the agent's own signal may just come second)
        return worker_notice(node, -event.code, now, rules, say(
            f"{who} before it connected to its agent: taken as this node's notice to leave"))
    if doomed:  # its group could not form: no failure of its own (see _rules._doomed_start)
        return node, [say(f"{who} (its group could not form): the workers restart in the "
                          "next round")]
    if node.restarts >= rules.max_restarts:
        return fail(node, f"workers failed after {node.restarts} restart(s) (--max-restarts "
                           f"{rules.max_restarts})")
    if (event.code > 0 and set_up_with is None) or not node.inprocess or rules.restart_on_change:
        return after_failure(node, who, now, rules)
    restarts = node.restarts + 1
    node = with_slot(replace(node, restarts=restarts, failures=node.failures + (who,),
                             started=now), lr, state=Worker.STARTING, step=None, join=True)
    # a sharded model: the node's other workers hold parts of a state that is whole nowhere
    # on it now; they end and start again too, and all join from another node's replica. And
    # workers started to join with it, not yet in, set up in one provisional group with it:
    # they start again with it too.
    peers = [p for p, s in enumerate(node.slots) if p != lr and (
        (node.sharded and s.state in (Worker.RUNNING, Worker.ENTERED, Worker.BROKEN)) or
        (set_up_with is not None and s.batch == set_up_with and
         s.state in (Worker.STARTING, Worker.FRESH)))]
    for peer in peers:
        node = with_slot(node, peer, state=Worker.ENDING, step=None)
    node = with_slot(node, lr, batch=batch(node, lr))
    why = "shard the model" if node.sharded else "set up to join"
    together = f"restarting the node's {len(peers) + 1} workers, which {why} together" \
        if peers else "restarting it alone"
    acts = [say(f"{who}: {together} (restart {restarts} of {rules.max_restarts}); "
                f"{'they join' if peers else 'it joins'} once warm"),
            act("replace", lr, node.slots[lr].batch),
            *(act("kill", peer) for peer in peers),
            act("event", "workers_restarted", {"restarts": restarts, "reason": who,
                                               "alone": not peers})]
    if stuck:
        return node, acts
    if node.phase is Phase.RUNNING:
        return join(node, *acts)
    if node.phase is Phase.AWAITING and node.decision is None:
        moved, more = cancel(node, "a worker crashed after this node's record")
        return moved, acts + more
    if node.phase is Phase.ENTERING or (node.phase is Phase.AWAITING and node.decision):
        moved, more = abandon(node, "a worker crashed while the group formed", now)
        return moved, acts + more
    if node.phase is Phase.SETTLING:
        moved, more = settle(node, [], rules)
        return moved, acts + more
    return node, acts


# -- leaving --
def batch(node: Node, lr: int) -> int | None:
    """The provisional group worker ``lr``, started again to join, sets up in: its node's
    restart count when every other worker of the node starts again with it (ending, or
    started in that batch already), else None (the others run: it joins alone, waiting for
    the switch in ``init_process_group``)."""
    if all(s.state is Worker.ENDING or (s.state is Worker.STARTING and s.batch == node.restarts)
           for p, s in enumerate(node.slots) if p != lr):
        return node.restarts
    return None


def on_leave_failed(node: Node, event: LeaveFailed, now: float, rules: Rules) -> Result:
    signum = node.leave.signum if node.leave is not None else signals.SIGTERM
    return stop_now(node, signum, f", but {event.why}")


def on_next(node: Node, event: NextSeen, now: float, rules: Rules) -> Result:
    if node.leave is None or not node.leave.announced:
        return node, []
    decision = event.decision
    if decision is None:
        return exit_with(node, 0, say("leaving: the grace period ended before the workers left; "
                                   "stopping them"), act("stop", node.leave.signum))
    if decision.kind is Kind.SWITCH and decision.step is not None and node.inprocess:
        return replace(node, leave=replace(node.leave, step=decision.step)), [
            say(f"leaving: the other nodes formed the next round without this node; its "
                 f"workers stop at step {decision.step}"), act("leave_plans", decision.step)]
    return exit_with(node, 0, say("leaving: the other nodes formed the next round without this "
                               "node; exiting"), act("stop", node.leave.signum))
