"""The node's protocol as tables (``rdzv/agent/_rules.py``): one row per state and event, and
the overlaps of issue 22 played without processes, clocks or stores."""

from __future__ import annotations

import signal
from dataclasses import replace
from typing import Any

import pytest

from rdzv._messages import (
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
from rdzv.agent._protocol import (
    Abandoned,
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
    NextSeen,
    Node,
    Phase,
    RecordsIn,
    Rules,
    Signalled,
    Slot,
    Tick,
    Unreadable,
    Worker,
)
from rdzv.agent._records import Assignment, Decision, Kind, SlotState
from rdzv.agent._moves import ABORT_CONFIRM, ABORT_PROBE, MAX_FAILED_TRANSITIONS
from rdzv.agent._rules import step

RULES = Rules(nproc=1, max_restarts=3, switch_timeout=60.0, leave_grace=30.0, min_nodes=1)
CONNECT_GRACE = RULES.connect_grace
NOW = 1000.0
MISFIT = Failed("the state received does not fit: size mismatch", misfit=True)


def running(gen: int = 3, group_rank: int = 1, nodes: int = 3, step_: int = 40,
            nproc: int = 1) -> Node:
    """A node whose workers train in round ``gen``'s group."""
    return Node(phase=Phase.RUNNING, gen=gen, group_rank=group_rank, nodes=nodes,
                slots=(Slot(Worker.RUNNING, step=step_),) * nproc, inprocess=True,
                group=Group("rdzv-old", group_rank * nproc, nodes * nproc,
                            tuple(range(nproc))))


def assignment(group_rank: int = 1, nodes: int = 3, local_ranks: tuple[int, ...] = (0,)
               ) -> Assignment:
    return Assignment(group_rank, nodes, group_rank, nodes, group_rank, nodes, "h", 1,
                      local_ranks)


def decided(kind: Kind, step_: int | None = 50, source: int | None = 0) -> Decision:
    return Decision(kind, "d1", step=step_, source=source, prefix="rdzv-d1", world_size=3,
                    nodes=3)


def entering(kind: Kind = Kind.SWITCH, gen: int = 4) -> Node:
    """A node whose workers got their plans for round ``gen``."""
    node = running(gen=3)
    return replace(node, phase=Phase.ENTERING, gen=gen, decision=decided(kind),
                   assignment=assignment(), deadline=NOW + 60, entering_since=NOW)


def sharded() -> Node:
    """A running node of two workers that shard the model together."""
    return replace(running(nproc=2), sharded=True,
                   slots=(Slot(Worker.RUNNING, step=40), Slot(Worker.RUNNING, step=40)))


def awaiting(coordinator: bool = False, gen: int = 4) -> Node:
    """Round ``gen`` formed, this node's record final, no decision yet."""
    node = running(gen=3, group_rank=0 if coordinator else 1)
    return replace(node, phase=Phase.AWAITING, gen=gen, record_final=True, deadline=NOW + 60)


def whats(acts: list[Any]) -> list[str]:
    return [a.what for a in acts if a.what not in ("say", "event")]


def worker(message: Any, local_rank: int = 0) -> FromWorker:
    return FromWorker(local_rank, message)


# Each row: (what it plays, the node before, the event, its phase after, the actions).
ROWS = [
    # -- a round forms --------------------------------------------------------------------
    ("a member's next round formed: it writes a final record at once",
     replace(running(), phase=Phase.FORMING), Formed(4, 1, 3), Phase.AWAITING,
     ["watch", "record"]),
    ("the coordinator says at once that the job runs in-process",
     replace(running(group_rank=0), phase=Phase.FORMING), Formed(4, 0, 3), Phase.AWAITING,
     ["watch", "hint", "record"]),
    ("a newcomer waits for the hint before it starts anything",
     Node(slots=(Slot(Worker.GONE),)), Formed(1, 2, 3), Phase.SETTLING, ["watch", "record"]),
    ("the first round: the coordinator has no workers, no in-process job",
     Node(slots=(Slot(Worker.GONE),)), Formed(1, 0, 2), Phase.AWAITING,
     ["watch", "hint", "record"]),
    ("the hint says in-process: the newcomer starts its workers now; nobody waits for them",
     replace(Node(slots=(Slot(Worker.GONE),)), phase=Phase.SETTLING, gen=1, group_rank=2,
             nodes=3), Hinted(1, True), Phase.AWAITING, ["start", "record"]),
    ("no in-process job: the newcomer's record is final without workers",
     replace(Node(slots=(Slot(Worker.GONE),)), phase=Phase.SETTLING, gen=1, group_rank=2,
             nodes=3), Hinted(1, False), Phase.AWAITING, ["record"]),
    ("a first start: the newcomer's record is final without workers",
     replace(Node(slots=(Slot(Worker.GONE),)), phase=Phase.SETTLING, gen=1, group_rank=2,
             nodes=3), Hinted(1, None), Phase.AWAITING, ["record"]),
    ("the newcomer's worker is warm while a round is decided: it joins after",
     replace(Node(slots=(Slot(Worker.STARTING, join=True),)), phase=Phase.AWAITING, gen=1,
             group_rank=2, nodes=3, inprocess=True, record_final=True),
     worker(Hello(0, 1, True)), Phase.AWAITING, []),
    ("the newcomer's workers are warm: it brings them in",
     replace(Node(slots=(Slot(Worker.STARTING, join=True),)), phase=Phase.RUNNING, gen=1,
             group_rank=2, nodes=3, inprocess=True), worker(Hello(0, 1, True)),
     Phase.FORMING, ["join"]),
    ("the job is over: a node whose workers finished it waits for the others",
     replace(awaiting(), slots=(Slot(Worker.DONE),)), Decided(4, decided(Kind.FINISH)),
     Phase.FINISHED, ["watch", "done"]),
    ("the job is over before the newcomer's workers joined: it stops them and waits too",
     replace(awaiting(), slots=(Slot(Worker.FRESH, join=True),)),
     Decided(4, decided(Kind.FINISH)), Phase.FINISHED, ["stop", "watch", "done"]),
    ("the job is over: the coordinator tells the old round's leavers too",
     replace(awaiting(coordinator=True), slots=(Slot(Worker.DONE),)),
     Decided(4, decided(Kind.FINISH)), Phase.FINISHED, ["next", "watch", "done"]),
    ("finished, every node too: it ends", replace(running(), phase=Phase.FINISHED,
                                                  slots=(Slot(Worker.DONE),)),
     AllFinished(3), Phase.EXITED, ["succeed", "exit"]),
    ("finished, the run closed by another node: it ends",
     replace(running(), phase=Phase.FINISHED, slots=(Slot(Worker.DONE),)),
     Changed(3, closed=True), Phase.EXITED, ["succeed", "exit"]),
    ("finished, a node lost or joining: it joins the next round, which decides",
     replace(running(), phase=Phase.FINISHED, slots=(Slot(Worker.DONE),)),
     Changed(3, lost=1), Phase.FORMING, ["join"]),
    ("a newcomer's workers start to join: the job's end does not wait for them",
     replace(awaiting(), group=None, slots=(Slot(Worker.STARTING, join=True),),
             decision=decided(Kind.STAY)), Assigned(4, assignment(local_ranks=())),
     Phase.RUNNING, ["outside", "watch"]),
    ("... also under a switch of the others",
     replace(awaiting(), group=None, slots=(Slot(Worker.STARTING, join=True),),
             decision=decided(Kind.SWITCH)), Assigned(4, assignment(local_ranks=())),
     Phase.RUNNING, ["outside", "watch"]),
    ("the job ended (closed) before the newcomer's workers joined: it stops them and ends",
     replace(running(), group=None, slots=(Slot(Worker.STARTING, join=True),)),
     Changed(3, closed=True), Phase.EXITED, ["stop", "exit"]),
    ("... also when they were warm and it was forming the next round (closed)",
     replace(running(), phase=Phase.FORMING, group=None,
             slots=(Slot(Worker.FRESH, join=True),)),
     FormFailed("closed", "the rendezvous is closed"), Phase.EXITED, ["stop", "exit"]),
    ("every record is in: the coordinator decides",
     awaiting(coordinator=True), RecordsIn(4, {}), Phase.AWAITING, ["decide"]),
    ("the decision: read this node's assignment", awaiting(), Decided(4, decided(Kind.SWITCH)),
     Phase.AWAITING, ["fetch"]),
    ("a switch: the plans go to the workers", replace(awaiting(), decision=decided(Kind.SWITCH)),
     Assigned(4, assignment()), Phase.ENTERING, ["plans"]),
    ("a recovery: the workers' group is aborted, then the plans",
     replace(awaiting(), decision=decided(Kind.RECOVER)), Assigned(4, assignment()),
     Phase.ENTERING, ["abort", "plans"]),
    ("a restart: the only fallback; stop, start anew",
     replace(awaiting(), decision=decided(Kind.RESTART)), Assigned(4, assignment()),
     Phase.RUNNING, ["stop", "start", "watch"]),
    ("a node that had finished stays finished when the others change in-process",
     replace(awaiting(), slots=(Slot(Worker.DONE),), decision=decided(Kind.SWITCH)),
     Assigned(4, assignment(local_ranks=())), Phase.FINISHED, ["watch", "done"]),
    ("stay: the running group is the round's; nothing changes for the workers",
     replace(awaiting(), decision=decided(Kind.STAY)), Assigned(4, assignment()),
     Phase.RUNNING, ["watch"]),
    ("the coordinator tells the old round's leavers how it moved on",
     replace(awaiting(coordinator=True), decision=decided(Kind.SWITCH)),
     Assigned(4, assignment(0)), Phase.ENTERING, ["next", "plans"]),
    ("every worker is in the new group: the node runs in the round",
     entering(), worker(Entered(4, 12.0, 50)), Phase.RUNNING, ["adopt", "watch"]),
    ("its workers entered while another of its workers got warm: it adopts the group (the "
     "decision goes with the action), then brings the warm one in",
     replace(entering(), slots=(Slot(Worker.RUNNING, step=40), Slot(Worker.FRESH))),
     worker(Entered(4, 12.0, 50)), Phase.FORMING, ["adopt", "join"]),
    ("a worker started to join is warm while another of the node's still starts: wait for it "
     "(one switch for both)",
     replace(running(nproc=2), slots=(Slot(Worker.FRESH), Slot(Worker.STARTING, join=True)),
             started=NOW - 1), worker(Hello(0, 1, fresh=True)), Phase.RUNNING, []),
    ("the last worker started to join is warm: bring them all in",
     replace(running(nproc=2), slots=(Slot(Worker.FRESH), Slot(Worker.FRESH))),
     worker(Hello(1, 1, fresh=True), 1), Phase.FORMING, ["join"]),
    ("a worker started to join is still starting past the grace: the warm ones go in",
     replace(running(nproc=2), slots=(Slot(Worker.FRESH), Slot(Worker.STARTING, join=True)),
             started=NOW - CONNECT_GRACE - 1, deadline=NOW - 1), Tick(), Phase.FORMING,
     ["join"]),
    ("the first worker started to join is warm only past the grace (a loaded machine): its "
     "peer still starting gets the grace from now",
     replace(running(nproc=2), slots=(Slot(Worker.STARTING, join=True),
                                      Slot(Worker.STARTING, join=True)),
             started=NOW - CONNECT_GRACE - 2), worker(Hello(0, 1, fresh=True)), Phase.RUNNING,
     []),
    ("a warm worker waited the grace for its peer still starting: it goes in alone",
     replace(running(nproc=2), slots=(Slot(Worker.FRESH, sampled=NOW - CONNECT_GRACE - 1),
                                      Slot(Worker.STARTING, join=True)),
             started=NOW - 2 * CONNECT_GRACE, deadline=NOW - 1), Tick(), Phase.FORMING,
     ["join"]),
    ("an Entered of another round is no news", entering(), worker(Entered(3, 12.0, 50)),
     Phase.ENTERING, []),
    ("a round cancelled: join the next", awaiting(), Decided(4, decided(Kind.CANCEL)),
     Phase.FORMING, ["join"]),
    ("an event of an earlier round is dropped", awaiting(), Decided(3, decided(Kind.SWITCH)),
     Phase.AWAITING, []),
    # -- changes while running ----------------------------------------------------------------
    ("a node waits to join: the next round forms in the background, training goes on",
     running(), Changed(3, waiting=1), Phase.FORMING, ["join"]),
    ("a member leaves: the same", running(), Changed(3, leaving=1), Phase.FORMING, ["join"]),
    ("a member is lost: form the next round (its decision aborts the group if it lost a rank)",
     running(), Changed(3, lost=1), Phase.FORMING, ["losses", "join"]),
    ("a worker's group failed (a peer is gone)", running(), worker(Broken(40)),
     Phase.FORMING, ["join"]),
    ("a worker crashed: restarted alone, the others go on without it",
     running(), Exited(0, -signal.SIGKILL), Phase.FORMING, ["replace", "join"]),
    ("a worker failed outside the API: the restart fallback",
     running(), Exited(0, 1, "ValueError: bug"), Phase.FORMING, ["join"]),
    ("the restarted worker is warm: bring it into the group",
     replace(running(), slots=(Slot(Worker.STARTING, join=True),)),
     worker(Hello(0, 1, True)), Phase.FORMING, ["join"]),
    ("every worker succeeded", running(), Exited(0, 0), Phase.FINISHED, ["done"]),
    ("every worker succeeded while the next round forms: the round tells (below)",
     replace(running(), phase=Phase.FORMING), Exited(0, 0), Phase.FORMING, []),
    ("every worker succeeded while the round settles: the record says so",
     replace(awaiting(), phase=Phase.SETTLING, record_final=False), Exited(0, 0),
     Phase.AWAITING, ["record"]),
    ("every worker succeeded while the decision is awaited: the round tells",
     awaiting(), Exited(0, 0), Phase.AWAITING, []),
    ("a restart (another node's worker failed) after this node's workers succeeded: they "
     "start anew", replace(awaiting(), slots=(Slot(Worker.DONE),),
                           decision=decided(Kind.RESTART)),
     Assigned(4, assignment()), Phase.RUNNING, ["stop", "start", "watch"]),
    ("a switch after this node's workers succeeded (their record was older): abandon it",
     replace(awaiting(), slots=(Slot(Worker.DONE),), decision=decided(Kind.SWITCH)),
     Assigned(4, assignment()), Phase.FORMING, ["abort", "abandon", "join"]),
    # -- overlaps (issue 22) ------------------------------------------------------------------
    ("a loss during a planned switch: abandon it, recover in the next round",
     entering(Kind.SWITCH), Changed(4, lost=1), Phase.FORMING, ["abort", "abandon", "join"]),
    ("a join during a recovery: the recovery goes on (the join is taken up after)",
     entering(Kind.RECOVER), Changed(4, waiting=1), Phase.ENTERING, []),
    ("a join while the round's decision is awaited: no news now", awaiting(),
     Changed(4, waiting=1), Phase.AWAITING, []),
    ("a leave during a join: the node leaves once the join is over",
     awaiting(), Signalled(signal.SIGTERM), Phase.AWAITING, []),
    ("a second loss during a recovery: abandon it, recover again",
     entering(Kind.RECOVER), Changed(4, lost=1), Phase.FORMING, ["abort", "abandon", "join"]),
    ("a second loss before the recovery's decision: cancel (fenced) the round",
     awaiting(), Changed(4, lost=1), Phase.AWAITING, ["cancel"]),
    ("a newcomer dies before it is warm: the coordinator cancels the round",
     replace(awaiting(coordinator=True), phase=Phase.AWAITING), Changed(4, lost=1),
     Phase.AWAITING, ["cancel"]),
    ("another node could not enter the group: abandon, recover",
     entering(), Abandoned(4), Phase.FORMING, ["abort", "abandon", "join"]),
    ("a member moved on after the decision without a word (no worker of it in the group): "
     "the others enter all the same", entering(), Changed(4, moved=1), Phase.ENTERING, []),
    ("its workers left the job (the node leaves): they get to exit by themselves, then the "
     "node exits", replace(running(), leave=Leave(signal.SIGTERM, NOW + 30, announced=True)),
     FromWorker(0, Left(55)), Phase.EXITED, ["let_go", "exit"]),
    ("a decision this node cannot read (another rdzv version): the run fails, saying so",
     awaiting(), Unreadable(4, "the round's decision cannot be read: malformed step"),
     Phase.EXITED, ["stop", "fail", "exit"]),
    ("an assignment this node cannot read: the run fails, saying so",
     replace(awaiting(), decision=decided(Kind.SWITCH)),
     Unreadable(4, "this node's assignment cannot be read"), Phase.EXITED,
     ["stop", "fail", "exit"]),
    ("what could not be read in an earlier round is no news",
     running(gen=4), Unreadable(3, "the round's decision cannot be read"), Phase.RUNNING, []),
    ("the node cancelled (a participant lost), but the decision was written first: abandon",
     replace(awaiting(), cancelled="1 participant(s) lost before the decision"),
     Decided(4, decided(Kind.SWITCH)), Phase.FORMING, ["abort", "abandon", "join"]),
    ("a worker crashed while the decision was awaited, the decision came first: abandon",
     replace(awaiting(), cancelled="a worker crashed after this node's record"),
     Decided(4, decided(Kind.RECOVER)), Phase.FORMING, ["abort", "abandon", "join"]),
    ("a worker crash while a round's decision is awaited: cancel the round",
     awaiting(), Exited(0, -signal.SIGKILL), Phase.AWAITING, ["replace", "cancel"]),
    ("a worker crash while entering: abandon the round",
     entering(), Exited(0, -signal.SIGKILL), Phase.FORMING,
     ["replace", "abort", "abandon", "join"]),
    ("a worker crash on group rank 0, global rank 0: the same as anywhere",
     running(group_rank=0), Exited(0, -signal.SIGKILL), Phase.FORMING, ["replace", "join"]),
    # -- a sharded model (HSDP): the node's workers hold one replica together -----------------
    ("a worker says the model is sharded over its node: no act, the node knows",
     replace(running(nproc=2), slots=(Slot(Worker.RUNNING), Slot(Worker.RUNNING))),
     worker(Shards()), Phase.RUNNING, []),
    ("a worker of a sharded node crashed: its peer ends too, both rejoin from a replica",
     replace(sharded(), phase=Phase.RUNNING), Exited(0, -signal.SIGKILL), Phase.FORMING,
     ["replace", "kill", "join"]),
    ("a sharded node's crash while entering: the same, the round abandoned",
     replace(sharded(), phase=Phase.ENTERING, decision=decided(Kind.SWITCH),
             assignment=assignment(local_ranks=(0, 1))), Exited(0, -signal.SIGKILL),
     Phase.FORMING, ["replace", "kill", "abort", "abandon", "join"]),
    ("the peer ended by its agent exits: it starts again, to join",
     replace(sharded(), slots=(Slot(Worker.STARTING, join=True), Slot(Worker.ENDING))),
     Exited(1, -signal.SIGKILL), Phase.RUNNING, ["replace"]),
    ("the peer being ended reports its group broken (its local peer died): no news, it stays "
     "ending", replace(sharded(), slots=(Slot(Worker.ENDING), Slot(Worker.STARTING, join=True))),
     worker(Broken(40)), Phase.RUNNING, []),
    ("a warm restarted worker waits while its peer still ends: one switch for both",
     replace(sharded(), slots=(Slot(Worker.FRESH), Slot(Worker.ENDING)), started=NOW - 60),
     Tick(), Phase.RUNNING, []),
    ("a worker crash before it connected, API unknown: the restart fallback",
     replace(running(), slots=(Slot(Worker.STARTING),), inprocess=None),
     Exited(0, -signal.SIGKILL), Phase.FORMING, ["join"]),
    ("a worker crash before it connected, API known: restarted alone",
     replace(running(), slots=(Slot(Worker.STARTING),)), Exited(0, -signal.SIGKILL),
     Phase.FORMING, ["replace", "join"]),
    ("the old group failed while a switch is planned: the worker enters at once",
     entering(Kind.SWITCH), worker(Broken(45)), Phase.ENTERING, []),
    ("the new group failed while the worker entered it: abandon",
     entering(Kind.SWITCH), worker(Broken(45, round=4)), Phase.FORMING,
     ["abort", "abandon", "join"]),
    ("SIGTERM to the agent: a graceful leave", running(), Signalled(signal.SIGTERM),
     Phase.RUNNING, ["announce"]),
    ("SIGTERM to a worker: its node leaves gracefully", running(), worker(Term()),
     Phase.RUNNING, ["announce"]),
    ("SIGTERM to agent and workers, the workers' first: one notice, one leave",
     replace(running(), leave=Leave(signal.SIGTERM, NOW + 30, True, by_worker=True)),
     Signalled(signal.SIGTERM), Phase.RUNNING, []),
    ("SIGTERM to agent and workers, the agent's first: one notice, one leave",
     replace(running(), leave=Leave(signal.SIGTERM, NOW + 30, True)), worker(Term()),
     Phase.RUNNING, []),
    ("a second SIGTERM to the agent stops it at once",
     replace(running(), leave=Leave(signal.SIGTERM, NOW + 30, True)),
     Signalled(signal.SIGTERM), Phase.EXITED, ["stop", "exit"]),
    ("leaving: the others switch at step 60, so do its workers (then they stop)",
     replace(running(), leave=Leave(signal.SIGTERM, NOW + 30, True)),
     NextSeen(decided(Kind.SWITCH, 60)), Phase.RUNNING, ["leave_plans"]),
    ("leaving: the others recover (the group broke): it stops its workers and exits",
     replace(running(), leave=Leave(signal.SIGTERM, NOW + 30, True)),
     NextSeen(decided(Kind.RECOVER)), Phase.EXITED, ["stop", "exit"]),
    ("leaving: its workers' group failed: it exits (the others recover)",
     replace(running(), leave=Leave(signal.SIGTERM, NOW + 30, True)), worker(Broken(41)),
     Phase.EXITED, ["stop", "exit"]),
    ("this node's session expired (paused past its ttl): it re-forms",
     awaiting(), Expired("session gone"), Phase.FORMING, ["abort", "join"]),
    # -- time -----------------------------------------------------------------------------------
    ("no decision in time: cancel the round", replace(awaiting(), deadline=NOW - 1), Tick(),
     Phase.AWAITING, ["cancel"]),
    ("the workers did not enter in time: abandon, recover",
     replace(entering(), entering_since=NOW - 61, deadline=NOW - 1), Tick(), Phase.FORMING,
     ["abort", "abandon", "join"]),
    ("workers that never connect do not use the API: the record says so",
     replace(running(), phase=Phase.SETTLING, gen=4, slots=(Slot(Worker.STARTING),),
             inprocess=None, deadline=NOW - 1), Tick(), Phase.AWAITING, ["record"]),
    ("the run closed while the workers restarted in a new group (another node failed): they "
     "cannot form it; it stops them and fails",
     replace(running(), slots=(Slot(Worker.STARTING),)), Changed(3, closed=True),
     Phase.EXITED, ["stop", "closed", "exit"]),
    ("a worker that held the job's state cannot follow the plan: every worker restarts",
     entering(), worker(Failed("ranks [1] hold another state than their source")),
     Phase.FORMING, ["abort", "abandon", "join"]),
    ("a newcomer's worker cannot take the job's state: its node leaves alone, with an error; "
     "the run stays open and nobody restarts",
     replace(entering(), joining=True, slots=(Slot(Worker.FRESH, join=True),)),
     worker(MISFIT), Phase.EXITED, ["stop", "exit"]),
    ("a newcomer's worker in a group whose states are beyond agreement: every worker restarts",
     replace(entering(), joining=True, slots=(Slot(Worker.FRESH, join=True),)),
     worker(Failed("no node holds every part of the state at one step")), Phase.FORMING,
     ["abort", "abandon", "join"]),
    ("... also a crashed worker restarted alone, which now runs another program",
     replace(running(), slots=(Slot(Worker.FRESH, join=True),)),
     worker(MISFIT), Phase.EXITED, ["stop", "exit"]),
    ("the rendezvous closed under a spare: it leaves, its job done",
     Node(slots=(Slot(Worker.GONE),)), FormFailed("spare", "closed"), Phase.EXITED,
     ["spare_done", "exit"]),
]


@pytest.mark.parametrize(("node", "event", "phase", "expected"),
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_the_protocol(node: Node, event: Any, phase: Phase, expected: list[str]) -> None:
    after, acts = step(node, event, NOW, RULES)
    assert (after.phase, whats(acts)) == (phase, expected)


def test_a_leave_during_a_transition_is_carried_out_once_it_is_over() -> None:
    node, _ = step(awaiting(), Signalled(signal.SIGTERM), NOW, RULES)
    assert node.leave is not None and not node.leave.announced
    node = replace(node, phase=Phase.ENTERING, decision=decided(Kind.SWITCH),
                   assignment=assignment(), entering_since=NOW)
    node, acts = step(node, worker(Entered(4, 10.0, 50)), NOW, RULES)
    assert node.phase is Phase.RUNNING and "announce" in whats(acts)
    assert node.leave is not None and node.leave.announced
    # and when the round restarts the workers (it waited out its grace, then stopped them)
    node, _ = step(awaiting(), Signalled(signal.SIGTERM), NOW, RULES)
    node, acts = step(replace(node, decision=decided(Kind.RESTART)), Assigned(4, assignment()),
                      NOW, RULES)
    assert node.phase is Phase.RUNNING and whats(acts)[-1] == "announce"
    assert node.leave is not None and node.leave.announced


def test_an_abandoned_group_is_reported_broken_in_the_next_record() -> None:
    node, _ = step(entering(), Changed(4, lost=1), NOW, RULES)
    assert [s.report(node.inprocess) for s in node.slots] == [SlotState.BROKEN]
    assert node.restart_why is None and node.failed_transitions == 1


def test_transitions_that_keep_failing_end_in_a_restart() -> None:
    node = entering()
    for _ in range(MAX_FAILED_TRANSITIONS - 1):
        node, _ = step(replace(node, phase=Phase.ENTERING, decision=decided(Kind.RECOVER),
                               assignment=assignment()), Changed(4, lost=1), NOW, RULES)
        assert node.restart_why is None
    node, _ = step(replace(node, phase=Phase.ENTERING, decision=decided(Kind.RECOVER),
                           assignment=assignment()), Changed(4, lost=1), NOW, RULES)
    assert node.restart_cause == "transition_failed" and "3 transitions" in node.restart_why
    # a transition that completes counts as one once a step was done in its group
    entered, _ = step(replace(entering(), failed_transitions=2), worker(Entered(4, 10.0, 50)),
                      NOW, RULES)
    assert (entered.failed_transitions, entered.entered_at) == (2, 50)
    trained, _ = step(entered, worker(Progress(51)), NOW, RULES)
    assert trained.failed_transitions == 0


def test_groups_that_fail_before_a_step_in_them_end_in_a_restart() -> None:
    """A worker whose every group fails at once (a deterministic error taken for a lost peer)
    would recover again and again at one step: each such group counts as a failed
    transition."""
    node = replace(running(), entered_at=40)
    for count in range(1, MAX_FAILED_TRANSITIONS):
        node, _ = step(replace(node, phase=Phase.RUNNING), worker(Broken(40)), NOW, RULES)
        assert (node.failed_transitions, node.restart_why) == (count, None)
    node, _ = step(replace(node, phase=Phase.RUNNING), worker(Broken(40)), NOW, RULES)
    assert node.restart_cause == "transition_failed"
    assert node.restart_why == ("3 transitions in a row failed at step 40, where their group "
                                "was entered, before a step in it")
    # a group the workers trained in: a failure of it is a loss, and the count starts anew
    node, _ = step(replace(running(), entered_at=40, failed_transitions=2), worker(Broken(41)),
                   NOW, RULES)
    assert node.failed_transitions == 0 and node.restart_why is None
    # a newcomer's failure is no transition of this node's trained group
    node, _ = step(replace(running(), entered_at=40, failed_transitions=2),
                   worker(Broken(40, fresh=True)), NOW, RULES)
    assert node.failed_transitions == 2 and node.restart_why is None


def test_a_member_lost_while_the_workers_start_in_its_group_restarts_them_at_once() -> None:
    """Workers started in a group wait in init_process_group for all of its members: one lost
    meanwhile means they never finish starting (nor connect). The node's record says so at
    once (a restart), where it used to wait for them until the switch timeout."""
    starting = replace(running(), slots=(Slot(Worker.STARTING),))
    node, acts = step(starting, Changed(3, lost=1), NOW, RULES)
    assert node.phase is Phase.FORMING and whats(acts) == ["losses", "join"]
    assert node.restart_cause == "lost_at_start" and node.slots[0].state is Worker.BROKEN
    node, acts = step(node, Formed(4, 1, 2), NOW, RULES)
    assert node.phase is Phase.AWAITING and node.record_final  # (not waiting for them)
    assert node.restart_why == ("the workers were starting in a group that lost a member, or "
                                "one leaving")
    # seen while a round forms: the round is cancelled, and the next record asks the restart
    node, acts = step(replace(awaiting(), slots=(Slot(Worker.STARTING),)), Changed(4, lost=1),
                      NOW, RULES)
    assert "cancel" in whats(acts) and node.restart_cause == "lost_at_start"
    # not known yet whether they use the API: within the grace to connect, they may be starting
    unknown = replace(starting, inprocess=None, started=NOW - CONNECT_GRACE + 1)
    node, _ = step(unknown, Changed(3, lost=1), NOW, RULES)
    assert node.restart_cause == "lost_at_start" and node.slots[0].state is Worker.BROKEN
    node, _ = step(replace(unknown, started=NOW - CONNECT_GRACE), Changed(3, lost=1), NOW,
                   RULES)  # (past it, they run a program without the API: its decision)
    assert node.restart_cause == "" and node.slots[0].state is Worker.STARTING
    joiner = replace(running(), slots=(Slot(Worker.STARTING, join=True),))
    node, _ = step(joiner, Changed(3, lost=1), NOW, RULES)  # (a joiner waits for a plan)
    assert node.restart_cause == "" and node.slots[0].state is Worker.STARTING
    # the member lost is this node (paused past its session): the others left the group
    # (seen in the chaos soak, seed 16: its record waited 30 s for workers that never came)
    node, acts = step(starting, Expired("session gone"), NOW, RULES)
    assert node.phase is Phase.FORMING and node.restart_cause == "lost_at_start"
    node, _ = step(node, Formed(4, 1, 3), NOW, RULES)
    assert node.phase is Phase.AWAITING and node.record_final


def test_a_member_leaving_while_the_workers_start_in_its_group_restarts_them_at_once() -> None:
    """A leaver's workers may be stopped with it (Slurm signals every process of the node), and
    the others' starting workers would wait in init_process_group for them until the connect
    timeout: a leave is taken as a loss (seen in the training chaos soak, seed 14, where the
    survivors of such a leave stalled 23 s). Neither counts as a restart of this node's own:
    with --max-restarts 0 the job goes on."""
    starting = replace(running(), slots=(Slot(Worker.STARTING),))
    node, acts = step(starting, Changed(3, leaving=1), NOW, RULES)
    assert node.phase is Phase.FORMING and whats(acts) == ["join"]  # (no losses to report)
    assert node.restart_cause == "lost_at_start" and node.slots[0].state is Worker.BROKEN
    own = replace(starting, leave=Leave(signal.SIGTERM, NOW + 30, announced=True))
    node, acts = step(own, Changed(3, leaving=1), NOW, RULES)  # (its own notice: nothing)
    assert node.restart_cause == "" and acts == []
    node, _ = step(own, Changed(3, leaving=2), NOW, RULES)  # (its own, and another's)
    assert node.restart_cause == "lost_at_start"
    pending = replace(starting, leave=Leave(signal.SIGTERM, NOW + 30))  # (not announced yet)
    node, _ = step(pending, Changed(3, leaving=1), NOW, RULES)
    assert node.restart_cause == "lost_at_start"
    unknown = replace(starting, inprocess=None, started=NOW - 1)  # (within the grace)
    node, _ = step(unknown, Changed(3, leaving=1), NOW, RULES)
    assert node.restart_cause == "lost_at_start"
    node, _ = step(replace(unknown, started=NOW - CONNECT_GRACE), Changed(3, leaving=1), NOW,
                   RULES)
    assert node.restart_cause == "" and node.phase is Phase.FORMING
    failed = replace(starting, restart_why="local rank 0 ended with exit code 1",
                     restart_cause="worker_failed")  # (a failure first: it counts still)
    node, _ = step(failed, Changed(3, leaving=1), NOW, RULES)
    assert node.restart_cause == "worker_failed"
    # settling, the record waits for the workers to connect: a leave makes it final at once
    settling = replace(starting, phase=Phase.SETTLING, gen=4, deadline=NOW + CONNECT_GRACE)
    node, acts = step(settling, Changed(4, leaving=1), NOW, RULES)
    assert node.phase is Phase.AWAITING and node.record_final and whats(acts) == ["record"]
    strict = replace(RULES, max_restarts=0)
    node, _ = step(starting, Changed(3, leaving=1), NOW, strict)
    node, _ = step(node, Formed(4, 1, 2), NOW, strict)
    # the doomed worker fails at last (its peer's port closed), before the round decides
    node, acts = step(node, Exited(0, 1, "RuntimeError: Connection refused"), NOW, strict)
    assert "fail" not in whats(acts) and node.slots[0].state is Worker.GONE
    node, _ = step(node, Decided(4, replace(decided(Kind.RESTART), world_size=2, nodes=2)),
                   NOW, strict)
    node, acts = step(node, Assigned(4, assignment(nodes=2)), NOW, strict)
    assert node.phase is Phase.RUNNING and node.restarts == 0 and "start" in whats(acts)


def test_sigterm_to_workers_that_have_not_connected_is_their_nodes_notice() -> None:
    """Slurm signals every process of a node: workers started with the group (no handler
    before they connect) die of it, starting or doomed, and their agent may hear that before
    its own signal: a notice to leave, not a crash (with --max-restarts 0 the run failed). A
    program known not to use the API has no such handler ever: its worker crashed."""
    rules = replace(RULES, max_restarts=0)
    two = replace(running(nproc=2), slots=(Slot(Worker.STARTING),) * 2)
    node, acts = step(two, Exited(0, -signal.SIGTERM), NOW, rules)
    assert node.leave is not None and node.leave.by_worker and "fail" not in whats(acts)
    assert "before it connected to its agent: taken as this node's notice" in acts[0].args[0]
    doomed, _ = step(two, Changed(3, lost=1), NOW, rules)
    node, acts = step(doomed, Exited(0, -signal.SIGTERM), NOW, rules)
    assert node.leave is not None and "fail" not in whats(acts)
    one = replace(running(), slots=(Slot(Worker.STARTING),))  # (its node has none left: ends)
    node, acts = step(one, Exited(0, -signal.SIGTERM), NOW, rules)
    assert node.phase is Phase.EXITED and acts[-1].args == (128 + signal.SIGTERM,)
    assert "fail" not in whats(acts)
    node, acts = step(replace(one, inprocess=False), Exited(0, -signal.SIGTERM), NOW, rules)
    assert "fail" in whats(acts)


def test_a_crashed_worker_is_absent_until_warm_then_fresh() -> None:
    node, _ = step(running(), Exited(0, -signal.SIGKILL), NOW, RULES)
    assert node.restarts == 1 and [s.report(True) for s in node.slots] == [SlotState.ABSENT]
    node, _ = step(replace(node, phase=Phase.RUNNING), worker(Hello(0, 7, True)), NOW, RULES)
    assert [s.report(True) for s in node.slots] == [SlotState.FRESH]


def test_a_sharded_node_restarts_its_workers_together_counted_once() -> None:
    node, acts = step(replace(sharded(), phase=Phase.RUNNING), Exited(1, -signal.SIGKILL), NOW,
                      RULES)
    replaced = [a.args for a in acts if a.what == "replace"]
    assert node.restarts == 1 and [s.state for s in node.slots] == [Worker.ENDING,
                                                                     Worker.STARTING]
    assert "restarting the node's 2 workers, which shard the model together" in acts[0].args[0]
    assert [s.report(True) for s in node.slots] == [SlotState.ABSENT, SlotState.ABSENT]
    node, acts = step(node, Exited(0, -signal.SIGKILL), NOW, RULES)
    assert node.restarts == 1 and whats(acts) == ["replace"]
    assert [s.state for s in node.slots] == [Worker.STARTING, Worker.STARTING]
    # both started again set up in one provisional group (the file of the node's restart 1)
    replaced += [a.args for a in acts if a.what == "replace"]
    assert replaced == [(1, 1), (0, 1)]


def test_a_worker_joining_with_its_node_crashes_while_they_set_up_together() -> None:
    """Workers started to join set up in one provisional group: one that dies there takes the
    others with it, and all start again in a new one; a worker joining alone, its node's others
    running, sets up in none."""
    joining = replace(running(nproc=2), slots=(Slot(Worker.FRESH, join=True, batch=2),
                                               Slot(Worker.STARTING, join=True, batch=2)),
                      restarts=2)
    node, acts = step(joining, Exited(1, -signal.SIGKILL), NOW, RULES)
    assert whats(acts) == ["replace", "kill", "join"] and node.restarts == 3
    assert [a.args for a in acts if a.what == "replace"] == [(1, 3)]
    assert [s.state for s in node.slots] == [Worker.ENDING, Worker.STARTING]
    node, acts = step(replace(node, phase=Phase.RUNNING), Exited(0, -signal.SIGKILL), NOW, RULES)
    assert [a.args for a in acts if a.what == "replace"] == [(0, 3)]
    # one whose set-up failed (a peer's death broke their group): the same, not a restart of all
    node, acts = step(joining, Exited(0, 1), NOW, RULES)
    assert whats(acts) == ["replace", "kill", "join"] and node.restarts == 3
    # started again alone, its node's other worker running: it sets up in no group
    alone = replace(running(nproc=2), slots=(Slot(Worker.RUNNING, step=40),
                                             Slot(Worker.STARTING, join=True)))
    node, acts = step(alone, Exited(1, -signal.SIGKILL), NOW, RULES)
    assert [a.args for a in acts if a.what in ("replace", "kill")] == [(1, None)]
    # ... and the other dies before the first is in: each alone still (they never met)
    node, acts = step(replace(node, phase=Phase.RUNNING), Exited(0, -signal.SIGKILL), NOW, RULES)
    assert [a.args for a in acts if a.what in ("replace", "kill")] == [(0, None)]


def test_sigterm_to_a_newcomer_setting_up_is_its_notice_whatever_its_agent_hears_first() -> None:
    """Slurm signals every process of a node: a newcomer's worker, still setting up (its
    SIGTERM handler comes once it connects), dies of it. Heard before the agent's own signal,
    that used to count as a crash: with --max-restarts 0 the run failed."""
    rules = replace(RULES, max_restarts=0)
    one = replace(running(), group=None, restarts=0,
                  slots=(Slot(Worker.STARTING, join=True, batch=0),))
    node, acts = step(one, Exited(0, -signal.SIGTERM), NOW, rules)
    assert node.phase is Phase.EXITED and whats(acts) == ["stop", "exit"]
    assert acts[-1].args == (128 + signal.SIGTERM,) and "fail" not in whats(acts)
    assert "taken as this node's notice to leave" in acts[0].args[0]
    two = replace(one, slots=(Slot(Worker.STARTING, join=True, batch=0),) * 2)
    node, acts = step(two, Exited(0, -signal.SIGTERM), NOW, rules)
    assert node.leave is not None and node.leave.by_worker and node.restarts == 0
    node, acts = step(node, Signalled(signal.SIGTERM), NOW, rules)  # the agent's: no news
    assert node.phase is not Phase.EXITED and acts == []
    # a worker that crashed in its set-up by itself is a crash still
    node, acts = step(one, Exited(0, 1), NOW, rules)
    assert "fail" in whats(acts)


def test_a_node_that_cannot_hold_the_jobs_state_exits_1_and_says_why() -> None:
    node = replace(entering(), joining=True, slots=(Slot(Worker.FRESH, join=True),))
    _, acts = step(node, worker(MISFIT), NOW, RULES)
    said = " ".join(a.args[0] for a in acts if a.what == "say")
    assert acts[-1].args == (1,) and "runs another program than the job's nodes" in said
    assert "(the state received does not fit: size mismatch)" in said
    # the run closed while its workers restarted: exit 1, where workers still to join exit 0
    _, acts = step(replace(running(), slots=(Slot(Worker.STARTING),)), Changed(3, closed=True),
                   NOW, RULES)
    assert acts[-1].args == (1,)
    _, acts = step(replace(running(), group=None, slots=(Slot(Worker.STARTING, join=True),)),
                   Changed(3, closed=True), NOW, RULES)
    assert acts[-1].args == (0,)
    # a program without the API (its workers never connect) is not taken for one that starts
    # or joins: the closed run waits for them to end, and their exit says how it went
    node, acts = step(replace(running(), inprocess=False, slots=(Slot(Worker.STARTING),)),
                      Changed(3, closed=True), NOW, RULES)
    assert node.phase is Phase.RUNNING and whats(acts) == []
    # the node that serves the store cannot leave the others without it: the run fails
    node = replace(entering(), joining=True, slots=(Slot(Worker.FRESH, join=True),))
    _, acts = step(node, worker(MISFIT), NOW, replace(RULES, hosts_store=True))
    assert whats(acts) == ["stop", "fail", "exit"] and acts[-1].args == (1,)


def test_restarts_are_bounded_by_max_restarts() -> None:
    node = replace(running(), restarts=RULES.max_restarts)
    node, acts = step(node, Exited(0, -signal.SIGKILL), NOW, RULES)
    assert node.phase is Phase.EXITED and whats(acts) == ["stop", "fail", "exit"]


def test_progress_reports_keep_the_record_current() -> None:
    node, acts = step(running(), worker(Progress(57, 0.06)), NOW, RULES)
    assert (node.slots[0].step, node.slots[0].step_time, acts) == (57, 0.06, [])


def test_workers_started_to_join_wait_for_each_other_from_the_first_warm_one() -> None:
    slow = replace(running(nproc=2), slots=(Slot(Worker.STARTING, join=True),
                                            Slot(Worker.STARTING, join=True)),
                   started=NOW - CONNECT_GRACE - 2)  # a start-up slowed past the grace
    node, acts = step(slow, worker(Hello(0, 1, fresh=True)), NOW, RULES)
    assert node.phase is Phase.RUNNING and node.deadline == NOW + CONNECT_GRACE and acts == []
    node, acts = step(node, worker(Hello(1, 1, fresh=True), 1), NOW + 1, RULES)
    assert node.phase is Phase.FORMING and whats(acts) == ["join"]  # both in one switch


def test_a_first_start_does_not_take_the_workers_for_ones_without_the_api() -> None:
    """The first round's coordinator can say only that nobody's workers run yet: a member that
    took that for "no in-process API" reported its workers, still importing torch when a node
    joined seconds later, as running without it, and every worker restarted."""
    first, acts = step(Node(slots=(Slot(Worker.GONE),)), Formed(1, 0, 2), NOW, RULES)
    assert [a.args for a in acts if a.what == "hint"] == [(None,)]
    member = replace(Node(slots=(Slot(Worker.GONE),)), phase=Phase.SETTLING, gen=1,
                     group_rank=1, nodes=2)
    member, _ = step(member, Hinted(1, None), NOW, RULES)
    assert member.inprocess is None
    member = replace(member, phase=Phase.FORMING, slots=(Slot(Worker.STARTING),), started=NOW)
    member, acts = step(member, Formed(2, 1, 3), NOW + 3, RULES)  # a node joins
    assert member.phase is Phase.SETTLING and not member.record_final  # it waits for them
    member, acts = step(member, worker(Hello(0, 1)), NOW + 9, RULES)
    assert member.inprocess and member.record_final and whats(acts) == ["record"]
    assert [s.report(member.inprocess) for s in member.slots] == [SlotState.RUNNING]
    # a coordinator whose workers never connected within the grace: they do not use the API
    late = replace(first, phase=Phase.FORMING, slots=(Slot(Worker.STARTING),), started=NOW)
    late, acts = step(late, Formed(2, 0, 3), NOW + 3, RULES)
    late, acts = step(late, Tick(), NOW + CONNECT_GRACE + 1, RULES)
    assert [a.args for a in acts if a.what == "hint"] == [(False,)] and late.inprocess is False


def test_workers_starting_connect_within_a_grace_or_never() -> None:
    starting = replace(running(), phase=Phase.FORMING, slots=(Slot(Worker.STARTING),),
                       inprocess=None, started=NOW - 1)
    node, _ = step(starting, Formed(4, 1, 3), NOW, RULES)
    assert node.phase is Phase.SETTLING and node.deadline == NOW - 1 + CONNECT_GRACE


def test_under_restart_on_change_a_round_does_not_wait_for_workers_still_starting() -> None:
    """Every change restarts the workers under ``--restart-on-change``: a round formed while
    those of the last restart still import (a fault during a restart) is decided at once, not
    after they connect (seen in the chaos soak: 4 s per overlapping fault, each a restart
    anyway)."""
    starting = replace(running(), phase=Phase.FORMING, slots=(Slot(Worker.STARTING),),
                       started=NOW - 1)
    waits, acts = step(starting, Formed(4, 1, 3), NOW, RULES)
    assert waits.phase is Phase.SETTLING and not waits.record_final
    restarting = replace(RULES, restart_on_change=True)
    node, acts = step(starting, Formed(4, 1, 3), NOW, restarting)
    assert node.phase is Phase.AWAITING and node.record_final and whats(acts) == ["watch",
                                                                                   "record"]
    # a starting worker that fails meanwhile makes no second round: the decision restarts it
    crashed, acts = step(node, Exited(0, 1), NOW + 1, restarting)
    assert crashed.phase is Phase.AWAITING and whats(acts) == [] and crashed.restart_why
    # the coordinator tells a newcomer at once that nothing switches in-process (it does not
    # wait to learn whether its own workers, still starting, use the API)
    coordinator = replace(starting, group_rank=0, inprocess=None)
    node, acts = step(coordinator, Formed(4, 0, 3), NOW, restarting)
    assert [a.args for a in acts if a.what == "hint"] == [(False,)] and node.record_final
    node, acts = step(coordinator, Formed(4, 0, 3), NOW, RULES)
    assert not any(a.what == "hint" for a in acts) and not node.record_final
    # (records that say so decide a restart: test_decide's row of a record without the API)
    # workers silent past --worker-connect-timeout do not use the API, whatever the mode: a
    # SIGTERM that ends one later is a failure, not its node's notice to leave
    silent = replace(starting, inprocess=None, started=NOW - CONNECT_GRACE - 1)
    for rules in (RULES, restarting):
        known, _ = step(silent, Formed(4, 1, 3), NOW, rules)
        assert known.inprocess is False and known.phase is Phase.AWAITING
        assert known.deadline == NOW + rules.switch_timeout  # (the decision's own wait)
        assert step(known, Tick(), NOW + 1, rules) == (known, [])
        ended, acts = step(known, Exited(0, -signal.SIGTERM), NOW + 1, rules)
        assert ended.leave is None and ended.restart_why == "local rank 0 ended with signal SIGTERM"


def stuck_after_expiry(nproc: int = 1) -> Node:
    """The seed-13 overlap of the training chaos soak (docs/train-chaos.md): this node was
    SIGSTOPped in a collective, its session expired, and back under a new one it is in a
    recovery whose group its worker must enter; but the worker still waits in the aborted
    group's collective (gloo can wait on a closed peer) and shows nothing."""
    node, acts = step(running(nproc=nproc), Expired("session gone"), NOW, RULES)
    assert "abort" in whats(acts) and node.slots[0].aborted_at == NOW
    node, _ = step(node, Formed(4, 1, 3), NOW + 0.1, RULES)
    assert [s.report(True) for s in node.slots] == [SlotState.BROKEN] * nproc  # (may be fine)
    node, _ = step(node, Decided(4, decided(Kind.RECOVER)), NOW + 0.1, RULES)
    node, acts = step(node, Assigned(4, assignment(local_ranks=tuple(range(nproc)))), NOW + 0.1,
                      RULES)
    assert node.phase is Phase.ENTERING and "plans" in whats(acts)
    assert node.deadline == NOW + ABORT_PROBE  # (not --switch-timeout, 60 s)
    return node


def asked(node: Node, bound: float = ABORT_CONFIRM) -> Node:
    """``ABORT_PROBE`` after the abort, the unshown workers are asked where they are; they
    have until ``bound`` after it to show."""
    same, acts = step(node, Tick(), NOW + ABORT_PROBE - 0.01, RULES)
    assert same.phase is Phase.ENTERING and acts == []
    node, acts = step(node, Tick(), NOW + ABORT_PROBE, RULES)
    assert node.phase is Phase.ENTERING and whats(acts) == ["probe"] * len(acts) and acts
    assert node.deadline == NOW + bound
    return node


def left_out(node: Node, *, answer: Where | None) -> Node:
    """Left out of the group being entered: by its answer, or for want of any sign."""
    if answer is not None:
        node, acts = step(node, worker(answer), NOW + 0.4, RULES)
        why = "blocked in a collective since the abort, 0.4 s ago"
    else:
        node, acts = step(node, Tick(), NOW + ABORT_CONFIRM, RULES)
        why = f"no sign of it {ABORT_CONFIRM:.1f} s after the abort"
    assert node.phase is Phase.FORMING and whats(acts) == ["abort", "abandon", "join"]
    assert f"local rank(s) 0 did not leave the aborted group ({why};" in acts[0].args[0]
    return node


@pytest.mark.parametrize("answer", [Where(40, waiting=True, stuck=True), None],
                         ids=["blocked in a collective", "no sign"])
def test_a_worker_stuck_in_an_aborted_group_is_left_out_of_the_next_one_at_once(
        answer: Where | None) -> None:
    node = left_out(asked(stuck_after_expiry()), answer=answer)
    # the next round forms without it (the others recover at once, not after its watch's 3 s)
    assert [s.report(True) for s in node.slots] == [SlotState.ABSENT]
    node, _ = step(node, Formed(5, 1, 3), NOW + 1.6, RULES)
    node, _ = step(node, Decided(5, decided(Kind.RECOVER)), NOW + 1.6, RULES)
    node, acts = step(node, Assigned(5, assignment(local_ranks=())), NOW + 1.6, RULES)
    assert node.phase is Phase.RUNNING and node.group is None
    out = node
    # its watch ends it: it restarts alone and joins once warm, like any crashed worker
    node, acts = step(out, Exited(0, -signal.SIGKILL), NOW + 3.0, RULES)
    assert node.slots[0] == Slot(Worker.STARTING, join=True, batch=node.slots[0].batch)
    assert "restarting it alone" in acts[0].args[0] and "replace" in whats(acts)
    # or it comes out of the collective after all: it holds its state again, and a round
    # brings it back (a recovery: the others' state is ahead of its own)
    node, acts = step(out, worker(Broken(40)), NOW + 2.0, RULES)
    assert node.slots[0].report(True) is SlotState.BROKEN and not node.slots[0].stuck
    assert node.phase is Phase.FORMING and whats(acts) == ["join"]


def test_a_worker_that_shows_it_left_the_aborted_group_is_waited_for() -> None:
    node = stuck_after_expiry()
    for shown in (Moving(4), Broken(40)):  # it took its plan; its collective failed
        moved, acts = step(node, worker(shown), NOW + 0.2, RULES)
        assert moved.slots[0].aborted_at is None and not whats(acts)
        moved, acts = step(moved, Tick(), NOW + ABORT_CONFIRM, RULES)
        assert moved.phase is Phase.ENTERING and acts == []  # it may create the group slowly
        assert moved.deadline == NOW + 0.1 + RULES.switch_timeout
    # asked, it computes (in its backward pass, say: waiting for the reduction as the hang
    # watch counts it, but not blocked): its next collective fails, or it takes its plan
    busy, acts = step(asked(node), worker(Where(40, waiting=True)), NOW + 0.4, RULES)
    assert busy.phase is Phase.ENTERING and acts == []
    # the answer to an earlier question of the hang watch is not taken for this one's
    hang = replace(asked(node), slots=(replace(asked(node).slots[0], probed=NOW - 1),))
    moved, acts = step(hang, worker(Where(40, waiting=True, stuck=True)), NOW + 0.4, RULES)
    assert moved.phase is Phase.ENTERING and moved.slots[0].probed is None and acts == []
    # asked late (past its bound already), it still has the time to answer
    late, acts = step(node, Tick(), NOW + 5.0, RULES)
    assert whats(acts) == ["probe"] and late.deadline == NOW + 5.0 + ABORT_PROBE
    # a worker with slow steps has three of them
    asked(replace(node, slots=(replace(node.slots[0], longest=2.0),)), bound=6.0)
    # the workers of a sharded model are never left out alone (they restart together)
    whole = replace(node, sharded=True)
    moved, acts = step(whole, Tick(), NOW + ABORT_CONFIRM, RULES)
    assert moved.phase is Phase.ENTERING and acts == []
    assert moved.deadline == NOW + 0.1 + RULES.switch_timeout


def test_a_recovery_aborts_the_running_workers_and_bounds_their_wait_likewise() -> None:
    node = replace(awaiting(), decision=decided(Kind.RECOVER))
    node, acts = step(node, Assigned(4, assignment()), NOW, RULES)
    assert whats(acts) == ["abort", "plans"] and node.slots[0].aborted_at == NOW
    assert node.deadline == NOW + ABORT_PROBE
    # a planned switch aborts nothing: no bound
    node, acts = step(replace(awaiting(), decision=decided(Kind.SWITCH)),
                      Assigned(4, assignment()), NOW, RULES)
    assert node.slots[0].aborted_at is None and node.deadline == NOW + RULES.switch_timeout


def test_a_worker_left_out_that_shows_while_the_next_round_forms_is_brought_back() -> None:
    node = left_out(asked(stuck_after_expiry()), answer=None)
    node, _ = step(node, Formed(5, 1, 3), NOW + 1.6, RULES)
    assert node.phase is Phase.AWAITING and node.record_final  # (it reports the worker absent)
    node, acts = step(node, worker(Broken(40)), NOW + 2.0, RULES)  # out of the collective now
    assert node.phase is Phase.AWAITING and not whats(acts)
    node, _ = step(node, Decided(5, decided(Kind.RECOVER)), NOW + 2.0, RULES)
    node, acts = step(node, Assigned(5, assignment(local_ranks=())), NOW + 2.0, RULES)
    assert node.phase is Phase.FORMING and whats(acts)[-1] == "join"  # not stranded outside
    assert any("bringing it back in" in a.args[0] for a in acts if a.what == "say")
    assert [s.report(True) for s in node.slots] == [SlotState.BROKEN]  # a holder again


def test_the_end_of_a_worker_left_out_changes_no_round() -> None:
    """Two workers: local rank 0 stuck, 1 showed it left. The next round's group is entered
    by 1 alone when 0's watch ends it: 0 restarts alone; the round goes on, and counts no
    failed transition."""
    node = stuck_after_expiry(nproc=2)
    node, _ = step(node, worker(Moving(4), local_rank=1), NOW + 0.2, RULES)
    node, _ = step(node, worker(Moving(3), local_rank=0), NOW + 0.2, RULES)  # another round's
    assert [s.aborted_at for s in node.slots] == [NOW, None]
    node = left_out(asked(node), answer=Where(40, waiting=True, stuck=True))
    assert [s.report(True) for s in node.slots] == [SlotState.ABSENT, SlotState.BROKEN]
    failed = node.failed_transitions
    node, _ = step(node, Formed(5, 1, 3), NOW + 1.6, RULES)
    node, _ = step(node, Decided(5, decided(Kind.RECOVER)), NOW + 1.6, RULES)
    node, _ = step(node, Assigned(5, assignment(local_ranks=(1,))), NOW + 1.6, RULES)
    assert node.phase is Phase.ENTERING
    node, acts = step(node, Exited(0, -signal.SIGKILL), NOW + 3.0, RULES)
    assert node.phase is Phase.ENTERING and whats(acts) == ["replace"]
    assert node.failed_transitions == failed
    node, acts = step(node, worker(Entered(5, 10.0, 41), local_rank=1), NOW + 3.1, RULES)
    assert node.phase is Phase.RUNNING and node.group is not None
    assert node.group.local_ranks == (1,) and node.slots[0].state is Worker.STARTING
