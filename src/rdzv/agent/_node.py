"""The executor of a node's protocol: it turns what happens into the events of ``_protocol.py``,
asks :func:`~._rules.step` what to do, and does it.

Everything the node waits on arrives as an event on one queue: a round formed
(``next_rendezvous_async``), a worker spoke on the channel or exited (one thread per worker in
``waitpid``), the membership or the round's control keys changed (``_watch.py``), a signal.
The loop takes them one at a time; nothing here decides, and every action is bounded.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import sys
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable

from .._address import parse_endpoint
from .._patience import EVERY
from ..errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    SessionExpiredError,
    StoreConnectionError,
)
from ..rendezvous import AGENT_HINT, AGENT_LEAVING, AGENT_NEXT, RendezvousInfo, abandon_key
from ._crew import Crew, Said
from ._decide import DecideContext
from ._errors import WorkerFailure, failure_summary
from ._forming import Forming
from ._hang import hang_due
from ._health import Health, PerfSeen
from ._history import (
    MAX_FAILURES,
    failure_fields,
    heartbeat_every,
    record,
    report_losses,
)
from ._host import NodeHost
from ._protocol import (
    Act,
    Assigned,
    Decided,
    Exited,
    Expired,
    Formed,
    FormFailed,
    Hinted,
    LeaveFailed,
    Node,
    Phase,
    Rules,
    Signalled,
    Slot,
    Tick,
    Unreadable,
    Worker,
)
from ._records import Assignment, Decision, Kind, NodeRecord, dumps_decision
from ._round import (
    all_done,
    hosts_store,
    mark_alive,
    mark_done,
    reserve_workers_port,
    wait_until_others_left,
)
from ._round_io import (
    build_record,
    leaving_ranks,
    plans,
    read_assignment,
    write_cancel,
    write_decision,
    write_record,
)
from ._rules import step
from ._watch import (
    Watches,
    watch_finish,
    watch_membership,
    watch_next,
    watch_round,
    watch_store_up,
)
from ._workers import WorkerExited

logger = logging.getLogger(__name__)

LEAVE_TIMEOUT = 30.0
"""Seconds the node serving the store waits for the others to leave a finished round."""


@dataclass(frozen=True)
class RoundResult:
    """Event: the background rendezvous finished (its future holds the round or the error)."""

    future: "Future[RendezvousInfo]"


class NodeRun:
    """One node's run: the event loop and the actions of its protocol."""

    def __init__(self, agent: NodeHost) -> None:
        config = agent.config
        self.agent, self.config, self.handler = agent, config, agent.handler
        self.events = agent.events
        self.clock = agent.clock
        self.session_ttl = config.rendezvous_parameters().session_ttl
        """The store sessions' ttl: how long a lost member stays silent before it is gone."""
        self.rules = Rules(config.nproc_per_node, config.max_restarts, config.switch_timeout,
                           config.leave_grace, config.restart_on_change, config.min_nodes,
                           hang_timeout=config.hang_timeout,
                           connect_grace=config.worker_connect_timeout)
        self.node = Node(slots=(Slot(state=Worker.GONE),) * config.nproc_per_node)
        self.crew = Crew(agent)
        self.health = Health(agent, self.crew, str(getattr(self.handler, "node_id", "")))
        self.info: RendezvousInfo | None = None
        """The round the node is in (formed last)."""
        self.group_info: RendezvousInfo | None = None
        """The round whose group the workers run in."""
        self.exit_code: int | None = None
        self._future: Future[RendezvousInfo] | None = None
        self.forming = Forming(agent)
        self.watches = Watches(self.handler)
        self._failures: list[WorkerFailure] = []
        self._paused: tuple[float, str] | None = None
        """Since when this node's training is paused (its workers stopped), and why."""
        self._probing = False
        """Whether the store's server is watched (once a signal asked this node to leave)."""
        self._alive_marked = -1
        self._port = 0
        """The port this node reserved in the current round for a new group's store."""

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        self._do(Act("join"))
        while self.exit_code is None:
            try:
                event = self.events.get(timeout=self._wait())
            except queue.Empty:
                event = Tick()
            event = self._translate(event)
            if isinstance(event, Signalled):
                self._probe_store()
            if event is not None:
                self._step(event)
            if not isinstance(event, Tick) and self.exit_code is None and \
                    self._due() <= self.clock.monotonic():  # (a stream of events holds no time up)
                self._step(Tick())
        return self.exit_code

    def _step(self, event: Any) -> None:
        self.node, acts = step(self.node, event, self.clock.monotonic(), self.rules)
        for action in acts:
            self._do(action)

    def _probe_store(self) -> None:
        """Once asked to leave, watch that a tcp store's server still listens (see
        :func:`watch_store_up`)."""
        if self._probing or self.config.rdzv_backend != "tcp" or self.config.standalone:
            return
        self._probing = True
        host, port = parse_endpoint(self.config.rdzv_endpoint, None)
        self.watches.add("rdzv-store-probe", watch_store_up(host, port, self.events.put))

    def close(self) -> None:
        self.watches.close()
        self.crew.close(self.config.stop_timeout)

    def _due(self) -> float:
        """When the protocol next needs a Tick for a deadline of its own."""
        return min(self.node.deadline, hang_due(self.node, self.rules))

    def _wait(self) -> float:
        node, now = self.node, self.clock.monotonic()
        deadlines = [self._due(), now + EVERY]
        if node.leave is not None:
            deadlines.append(node.leave.deadline)
        if node.phase is Phase.FORMING:
            deadlines.append(now + 1.0)  # spare and progress lines
        return max(0.0, min(deadlines) - now)

    def _translate(self, event: Any) -> Any:
        """The protocol's event for what happened (None: nothing for the protocol)."""
        if isinstance(event, RoundResult):
            return self._formed(event.future) if event.future is self._future else None
        if isinstance(event, WorkerExited):
            return self._exited(event) if self.crew.current(event) else None
        if isinstance(event, Said):
            return self.crew.said(event)
        if isinstance(event, PerfSeen):
            if self.info is not None and event.gen == self.node.gen:
                self.health.assess(self.handler, self.info, event)
            return None
        if isinstance(event, Tick) and self.node.phase is Phase.FORMING:
            self.forming.tick(bool(self.node.live))
        return event

    def _formed(self, future: "Future[RendezvousInfo]") -> Any:
        try:
            info = future.result(timeout=0)
        except RendezvousGracefulExitError as exc:
            return FormFailed("graceful", str(exc))
        except RendezvousClosedError as exc:
            spare = self.forming.spare and not self._failures
            return FormFailed("spare" if spare else "closed", str(exc))
        except RendezvousTimeoutError as exc:
            return FormFailed("timeout", f"{type(exc).__name__}: {exc}")
        except StoreConnectionError as exc:
            return FormFailed("store", str(exc))
        except RendezvousError as exc:
            return FormFailed("error", f"{type(exc).__name__}: {exc}")
        self.info = info
        if self.node.gen == 0:
            self.rules = replace(self.rules, hosts_store=hosts_store(info.store))
        self._port = reserve_workers_port(self.agent.host)
        self.agent.say(f"round formed in {self.clock.monotonic() - self.forming.since:.2f} s: this "
                       f"node is group rank {info.rank} of {info.world_size}")
        return Formed(self.node.gen + 1, info.rank, info.world_size)

    def _exited(self, event: WorkerExited) -> Exited:
        assert self.crew.group is not None
        error, ended = "", self.health.ended.pop(event.local_rank, None)
        if event.returncode != 0:
            failure = self.agent.failure(self.crew.group, event.local_rank, event.returncode)
            self._failures.append(failure)
            self._paused = self._paused or (failure.time, "worker_failed")
            if len(self._failures) <= MAX_FAILURES:
                record(self.handler, "worker_failed", **failure_fields(failure))
            if failure.error is not None and failure.error.message:
                error = failure.error.message.strip().splitlines()[0][:200]
            error = ended or error
        return Exited(event.local_rank, event.returncode, error)

    # -- actions ------------------------------------------------------------------------------
    def _do(self, action: Act) -> None:
        handler: Callable[..., None] = getattr(self, f"_act_{action.what}")
        try:
            handler(*action.args)
        except SessionExpiredError as exc:
            self.events.put(Expired(str(exc)))
        except RendezvousError as exc:  # the store failed under an action: the deadlines go on
            logger.warning("%s failed: %s: %s", action.what, type(exc).__name__, exc)
            self.agent.say(f"cannot {action.what.replace('_', ' ')} ({type(exc).__name__}: "
                           f"{exc})")

    def _act_say(self, text: str) -> None:
        self.agent.say(text)

    def _act_event(self, kind: str, fields: dict[str, Any]) -> None:
        record(self.handler, kind, **fields)

    def _act_join(self) -> None:
        self.watches.stop_round()
        if self.node.gen == 0:
            config = self.config
            self.agent.say(f"waiting for nodes: {config.min_nodes}..{config.max_nodes} for run "
                           f"{config.run_id!r} ({config.rdzv_backend} {config.rdzv_endpoint})")
        self.forming.begin()
        future = self.handler.next_rendezvous_async()
        self._future = future
        future.add_done_callback(lambda f: self.events.put(RoundResult(f)))

    def _act_watch(self, gen: int) -> None:
        assert self.info is not None
        info, post, node = self.info, self.events.put, self.node
        transition = node.phase in (Phase.SETTLING, Phase.AWAITING, Phase.ENTERING)
        if not transition:  # the round's control keys are no news now, and a change seen
            self.watches.stop_round()  # while in the transition is news again
            self.group_info = info  # the workers run in this round now (also after a STAY)
        self.watches.membership(gen, watch_membership(
            self.handler, info.store, gen, post,
            lambda spares: self.health.beat(info, gen, self.node, spares, post),
            heartbeat_every(self.session_ttl), self.config.monitor_interval, self.clock))
        if transition:
            self.watches.round(gen, info.store, lambda store: watch_round(
                store, gen, post, node.coordinator, node.nodes, self.rules.switch_timeout,
                self.clock))

    def _act_record(self) -> None:
        info, node = self.info, self.node
        assert info is not None
        if self._alive_marked != node.gen:
            self._alive_marked = node.gen
            mark_alive(info)
        leaving = leaving_ranks(self.group_info.store) if self.group_info is not None else ()
        write_record(info.store, node, build_record(
            node, self.config, self.agent.host, self._port, leaving,
            getattr(self.handler, "node_id", None), self.clock.monotonic() - self.forming.since,
            self.agent.started))

    def _act_hint(self, inprocess: bool | None) -> None:
        assert self.info is not None
        self.info.store.set(AGENT_HINT, Hinted.WIRE[inprocess])

    def _act_decide(self, records: dict[int, NodeRecord | None], timed_out: bool) -> None:
        assert self.info is not None
        decision, current = write_decision(self.info.store, records, DecideContext(
            uuid.uuid4().hex[:12], str(getattr(self.handler, "node_id", "")), self.clock.time(),
            self.node.nodes, timed_out, self.rules.switch_timeout))
        if current == decision and decision.kind is Kind.RESTART:  # each fallback, once
            record(self.handler, "restart_fallback", cause=decision.cause, reason=decision.why)
        self.events.put(Decided(self.node.gen, current))

    def _act_cancel(self) -> None:
        assert self.info is not None
        self.events.put(Decided(self.node.gen, write_cancel(
            self.info.store, str(getattr(self.handler, "node_id", "")), self.node.group_rank)))

    def _act_abandon(self) -> None:
        if self.info is not None:
            self.info.store.set(abandon_key(self.node.group_rank), b"1")

    def _act_fetch(self) -> None:
        assert self.info is not None and self.node.decision is not None
        try:
            self.events.put(Assigned(self.node.gen, read_assignment(
                self.info.store, self.node.decision, self.node.group_rank)))
        except RendezvousStateError as exc:  # written, but not as this node reads it
            self.events.put(Unreadable(self.node.gen, f"this node's assignment cannot be "
                                                      f"read: {exc}"))

    def _act_plans(self) -> None:
        node = self.node
        decision, mine = node.decision, node.assignment
        assert decision is not None and mine is not None
        self.crew.send_plans(plans(node.gen, decision, mine))
        if decision.kind is Kind.SWITCH:
            self.agent.say(f"round {node.gen} decided: switching at step {decision.step}")
        else:
            source = ("nobody holds the state: the workers load their checkpoint"
                      if decision.source is None else
                      "every worker adopts the most advanced state")
            self.agent.say(f"round {node.gen} decided: recovering in-process ({decision.why}); "
                           f"{source}")

    def _act_abort(self) -> None:
        self.crew.abort()

    def _act_probe(self, local_rank: int) -> None:
        self.crew.probe(local_rank)

    def _act_hung(self, local_rank: int, *report: Any) -> None:
        self.health.hung(self.handler, local_rank, *report)

    def _act_start(self, join: bool) -> None:
        node = self.node
        assignment = None if join else node.assignment
        self.crew.start(assignment, node.restarts, self.config.stop_timeout)
        if assignment is None:
            record(self.handler, "workers_started", nproc=self.config.nproc_per_node,
                   group_rank=node.group_rank, restarts=node.restarts, joining=True)
        else:
            self.group_info = self.info
            self.agent.say(f"round complete: {self.agent.describe(assignment)}")
            record(self.handler, "workers_started", nproc=self.config.nproc_per_node,
                   group_rank=assignment.group_rank, world_size=assignment.world_size,
                   restarts=node.restarts)
            if self._paused is not None:
                since, cause = self._paused
                record(self.handler, "training_paused", pause_s=round(self.clock.time() - since, 6),
                       cause=cause)
                self._paused = None

    def _act_let_go(self) -> None:
        self.crew.let_go(self.config.stop_timeout)

    def _act_replace(self, local_rank: int, batch: int | None) -> None:
        self.crew.replace(local_rank, self.node.restarts, batch)

    def _act_kill(self, local_rank: int) -> None:
        self.crew.kill(local_rank)

    def _act_stop(self, signum: int) -> None:
        if self.crew.group is not None:
            self._paused = self._paused or (self.clock.time(), "membership_change")
            self.crew.stop(signum, self.config.stop_timeout)

    def _act_announce(self) -> None:
        info, node = self.info, self.node
        assert info is not None and node.leave is not None
        try:
            group = node.group
            info.store.set(f"{AGENT_LEAVING}{node.group_rank}", json.dumps(
                {"time": self.clock.time(), "host": self.agent.host,
                 "ranks": list(group.held(node.slots)) if group else []}))
            announced = self.handler.announce_leaving()
        except RendezvousError as exc:
            self.events.put(LeaveFailed(f"cannot announce that this node leaves ({exc})"))
            return
        if not announced:
            self.events.put(LeaveFailed("the rendezvous backend cannot announce a leave"))
            return
        self.watches.stop_round()  # this node's own announcement is no news
        self.watches.add("rdzv-leave", watch_next(
            info.store, self.events.put, max(0.0, node.leave.deadline - self.clock.monotonic()),
            self.clock))

    def _act_leave_plans(self, step_: int) -> None:
        self.crew.send_leave(self.node.gen, step_)

    def _act_next(self, decision: Decision) -> None:
        """Tell the nodes of the workers' previous round (a leaving one) how its members moved
        on: the next round's kind and switch step."""
        old = self.group_info
        if old is not None and old is not self.info:
            old.store.set(AGENT_NEXT, dumps_decision(decision))

    def _act_adopt(self, decision: Decision, mine: Assignment, newcomer: bool,
                   pause: float | None) -> None:
        node = self.node
        self.crew.renumber(mine)
        self.group_info = self.info
        ms, took = self.crew.pause(mine.local_ranks)
        at = max((node.slots[lr].step or 0 for lr in mine.local_ranks), default=0)
        recovered = decision.kind is Kind.RECOVER
        if newcomer:
            self.agent.say(f"the workers joined the running group in {took} at its step {at}: "
                           f"{self.agent.describe(mine)}")
        else:
            what = "recovered in-process" if recovered else "switched"
            self.agent.say(f"{what} in {took} at step {at}: {self.agent.describe(mine)}")
        record(self.handler, "recovered_in_process" if recovered else "switched_in_process",
               step=at, newcomer=newcomer or None, pause_s=round(ms / 1000, 6))
        if pause is not None:
            record(self.handler, "training_paused", pause_s=round(pause, 6),
                   cause="member_lost")

    def _act_losses(self) -> None:
        if self.group_info is not None:
            report_losses(self.handler, self.group_info, self.session_ttl)

    def _act_done(self) -> None:
        info = self._act_outside()
        self.watches.add("rdzv-finish", watch_finish(
            lambda: all_done(info), self.node.gen, self.events.put,
            self.config.monitor_interval))

    def _act_outside(self) -> RendezvousInfo:
        """Mark this node done in its round (``mark_done``): finished, or none of its workers
        in the group (the others' end of the job does not wait for those)."""
        assert self.info is not None
        try:
            mark_done(self.info)
        except RendezvousError as exc:
            logger.warning("cannot mark this node as done in its round: %s", exc)
        return self.info

    def _act_succeed(self) -> None:
        self.crew.stop(signal.SIGTERM, self.config.stop_timeout)
        self._close("workers_succeeded")
        self._let_others_leave()
        ran = any(s.state is Worker.DONE for s in self.node.slots)  # (not: came as it ended)
        self.agent.say("every node has finished" + ("; this node's workers succeeded" if ran
                                                      else ""))

    def _act_fail(self, why: str) -> None:
        print(failure_summary(self._failures, why), file=sys.stderr, flush=True)
        if self.info is not None:
            try:
                mark_done(self.info)
            except RendezvousError as exc:
                logger.warning("cannot mark this node as finished: %s", exc)
        self._close("workers_failed")
        self._let_others_leave(announce=True)

    def _act_closed(self, message: str) -> None:
        self.agent.say(f"the rendezvous is closed, the run has ended on the other nodes "
                       f"({message})")
        self._let_others_leave(announce=True)

    def _let_others_leave(self, announce: bool = False) -> None:
        """On the node serving the store, as the run ends: the others leave through it, and
        learn through it that it ended (a store gone first holds each for its read timeout,
        then tells it only that the store is gone); bounded by ``LEAVE_TIMEOUT``, ended by a
        signal; ``announce``: say so (a failed run's others may take a while)."""
        if self.info is None:
            return
        if announce and self.node.nodes > 1 and hosts_store(self.info.store):
            self.agent.say(f"this node serves the rendezvous store: waiting up to "
                           f"{LEAVE_TIMEOUT:g} s for the other nodes to see that the run ended "
                           "and leave (a signal stops the wait)")
        signals = self.agent.signals
        try:
            self.watches.stop_round()  # (its membership watch would share the client)
            wait_until_others_left(self.info, self.handler, LEAVE_TIMEOUT,
                                   stop=lambda: self.agent.signals != signals)
        except RendezvousError as exc:
            logger.warning("cannot wait for the other nodes to leave: %s", exc)

    def _act_spare_done(self) -> None:
        self.agent.say("the job finished without needing this spare node")

    def _act_store_lost(self) -> None:
        self.agent.store_gone = True

    def _act_exit(self, code: int) -> None:
        self.exit_code = code

    def _close(self, reason: str) -> None:
        try:
            self.handler.set_closed()
        except RendezvousError as exc:
            self.agent.say(f"could not close the rendezvous: {exc}")
            return
        if getattr(self.handler, "closed_here", True):  # one node says so: the one that closed it
            record(self.handler, "run_closed", reason=reason)
