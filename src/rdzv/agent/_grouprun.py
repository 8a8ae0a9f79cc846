"""One started worker group, watched until it ends: through in-process switches and a leave.

:class:`GroupRun` takes the agent's events one at a time and applies the pure decisions
(``on_worker_exit``, ``on_membership_change``, ``classify_change``). A planned change starts a
transition thread (``_transition.py``) and the workers keep training; when it ends, the group
either runs on in the new round (in-process) or the agent restarts it there. A first SIGTERM
or SIGINT makes the node leave gracefully: it announces it, keeps training until the others
have formed the next round without it, and its workers stop at the switch step.
"""

from __future__ import annotations

import enum
import json
import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import RendezvousError
from ..rendezvous import RendezvousInfo
from ._changes import Change, Mode, classify_change
from ._history import heartbeat_every, record, report_losses, session_ttl
from ._round import (
    ALIVE_DIR,
    CAPABLE_DIR,
    LEAVING_DIR,
    Assignment,
    MembershipChanged,
    MembershipWatcher,
    all_done,
    hosts_store,
    mark_alive,
)
from ._transition import (
    TransitionDone,
    WorkersBroken,
    WorkersConnected,
    member_transition,
    recovery_transition,
    start_on_thread,
    wait_for_switch,
)
from ._workers import WorkerExited, WorkerGroup

if TYPE_CHECKING:
    from ._agent import ElasticAgent

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL = 10.0
"""Seconds between idle turns of the event loop."""
EXIT_BARRIER_TIMEOUT = 300.0
"""Seconds a node whose workers succeeded waits for the other nodes to finish (torch's value)."""


class Action(enum.Enum):
    """What the agent does next."""

    CONTINUE = "continue"
    SUCCEED = "succeed"
    RESTART = "restart"
    """A worker failed: stop the group, re-rendezvous and restart (counted)."""
    REFORM = "reform"
    """The membership changed: stop the group, re-rendezvous and restart (not counted)."""
    FAIL = "fail"
    STOP = "stop"
    """A signal: stop the workers now and exit with 128 + the signal number."""
    LEFT = "left"
    """This node left the job gracefully: exit 0."""


@dataclass(frozen=True)
class AllDone:
    """Event: every node of round ``generation`` has finished."""

    generation: int


@dataclass(frozen=True)
class Signalled:
    """Event: the agent received ``signum``."""

    signum: int


@dataclass(frozen=True)
class LeaveNews:
    """Event: what the others decided after this node announced it leaves (None: grace over)."""

    generation: int
    decision: dict[str, Any] | None


@dataclass(frozen=True)
class Outcome:
    """How a group's run ended: the action, the signal (STOP), the round to restart in."""

    action: Action
    signum: int = 0
    formed: TransitionDone | None = None


def on_worker_exit(returncodes: Mapping[int, int | None], restarts: int,
                   max_restarts: int) -> Action:
    """The decision after a worker exited, given every worker's return code (None: running).

    A restart needs a new round: if the rendezvous turns out to be closed, the run fails then.
    """
    if any(code not in (None, 0) for code in returncodes.values()):
        return Action.RESTART if restarts < max_restarts else Action.FAIL
    if all(code == 0 for code in returncodes.values()):
        return Action.SUCCEED
    return Action.CONTINUE


def on_membership_change(closed: bool, finished: bool) -> Action:
    """The decision when the membership changed; ``finished``: this node's workers succeeded.

    A closed rendezvous (or a round whose nodes all finished) forms no new round: running
    workers run on to their end. Otherwise the group re-forms, also when this node's workers
    already succeeded: another node is restarting the job, which restarts every worker.
    """
    if closed:
        return Action.SUCCEED if finished else Action.CONTINUE
    return Action.REFORM


class GroupRun:
    """Watches one worker group of ``agent`` from its start until it must stop or restart."""

    def __init__(self, agent: "ElasticAgent", group: WorkerGroup, info: RendezvousInfo,
                 assignment: Assignment, joining: bool) -> None:
        self.agent = agent
        self.group = group
        self.info = info
        self.assignment = assignment
        self.transition = joining
        """A transition thread is running (a planned change, or this newcomer joining)."""
        self._watcher: MembershipWatcher | None = None
        self._finished_at: float | None = None
        self._closed_seen = False
        self._leaving: int | None = None
        """The signal that asked this node to leave, once it announced it."""
        self._leave_deadline = 0.0
        self._leave_step: int | None = None

    @property
    def generation(self) -> int:
        return self.agent.generation

    def run(self) -> Outcome:
        self._watch()
        try:
            while True:
                try:
                    event = self.agent.events.get(timeout=self._wait())
                except queue.Empty:
                    event = None
                outcome = self._on(event)
                if outcome is not None:
                    return outcome
        finally:
            self._unwatch()

    def _wait(self) -> float:
        deadlines = []
        if self._finished_at is not None:
            deadlines.append(self._finished_at + EXIT_BARRIER_TIMEOUT)
        if self._leaving is not None:
            deadlines.append(self._leave_deadline)
        if not deadlines:
            return PROGRESS_INTERVAL
        return max(0.0, min(min(deadlines) - time.monotonic(), PROGRESS_INTERVAL))

    # -- events -----------------------------------------------------------------------------
    def _on(self, event: Any) -> Outcome | None:
        if event is None:
            return self._on_tick()
        if isinstance(event, Signalled):
            return self._on_signal(event.signum)
        if getattr(event, "generation", None) != self.generation:
            return None  # an event of an earlier round
        if isinstance(event, WorkerExited):
            return self._on_worker_exit()
        if isinstance(event, MembershipChanged):
            return self._on_membership_change()
        if isinstance(event, AllDone):
            return Outcome(Action.SUCCEED)
        if isinstance(event, WorkersConnected):
            self._say_capable()
        elif isinstance(event, WorkersBroken):
            if not self.transition and self._leaving is None and self._recoverable():
                report_losses(self.agent.handler, self.info,
                              session_ttl(self.agent.config.rdzv_conf))
                self._start_recovery("a worker's process group failed (a peer is gone)")
        elif isinstance(event, TransitionDone):
            return self._on_transition_done(event)
        elif isinstance(event, LeaveNews):
            return self._on_leave_news(event.decision)
        return None

    def _on_tick(self) -> Outcome | None:
        now = time.monotonic()
        if self._leaving is not None and now >= self._leave_deadline:
            self.agent.say(f"leaving: the grace period of {self.agent.config.leave_grace:g} s "
                           "ended before the workers left; stopping them")
            self.group.stop(self._leaving, self.agent.config.stop_timeout)
            return Outcome(Action.LEFT)
        if self._finished_at is not None and now >= self._finished_at + EXIT_BARRIER_TIMEOUT:
            self.agent.say(f"not every node finished within {EXIT_BARRIER_TIMEOUT:g} s; "
                           "leaving anyway")
            return Outcome(Action.SUCCEED)
        return None

    def _on_worker_exit(self) -> Outcome | None:
        agent = self.agent
        if self._finished_at is not None:
            return None  # the exit of a worker already counted in the success
        codes = self.group.returncodes()
        if self._leaving is not None and self._leave_step is not None:
            if all(code is not None for code in codes.values()):
                agent.say(f"leaving: the other nodes formed the next round without this node; "
                          f"its workers left at step {self._leave_step}; exiting")
                return Outcome(Action.LEFT)
            return None
        action = on_worker_exit(codes, agent.restarts, agent.config.max_restarts)
        if action is Action.SUCCEED:
            self._finished_at = time.monotonic()
            agent.say(f"all {len(codes)} worker(s) of this node succeeded; waiting for the "
                      "other nodes to finish")
            agent.mark_done(self.info)
            if self._closed_seen:  # the run is over: nobody re-forms any more
                return Outcome(Action.SUCCEED)
            if self._watcher is not None:
                self._watcher.also_report(lambda: all_done(self.info), AllDone(self.generation))
            return None
        if action is Action.CONTINUE:
            return None
        if self._leaving is not None:  # failed while leaving: it leaves all the same
            agent.say("leaving: a worker failed while the node was leaving; exiting")
            self.group.stop(timeout=agent.config.stop_timeout)
            return Outcome(Action.LEFT)
        return Outcome(action, formed=self._end_transition())

    def _on_membership_change(self) -> Outcome | None:
        agent, handler = self.agent, self.agent.handler
        if self._leaving is not None or self.transition:
            return None  # this node's own announcement, or a change already being handled
        closed = handler.is_closed() or all_done(self.info)
        action = on_membership_change(closed, self._finished_at is not None)
        if action is Action.CONTINUE:
            self._closed_seen = True  # the watcher has ended: a closed run stays closed
            agent.say("the rendezvous was closed by another node; waiting for this node's "
                      "workers to finish")
            return None
        if action is Action.REFORM and self._finished_at is None:
            store = self.info.store
            try:
                waiting = handler.num_nodes_waiting()
                leaving = store.count_keys(LEAVING_DIR)
                alive = store.count_keys(ALIVE_DIR)
            except RendezvousError as exc:  # cannot tell what changed: as for a loss
                logger.warning("cannot read the membership change: %s", exc)
                waiting, leaving, alive = 0, 0, 0
            if 0 < alive < self.info.world_size:
                report_losses(handler, self.info, session_ttl(agent.config.rdzv_conf))
            change = classify_change(self.info.world_size, alive, leaving, waiting)
            if change is Change.PLANNED:
                self._start_transition(waiting, leaving)
                return None
            if self._recoverable():
                self._start_recovery("a member of the round was lost")
                return None
        if action is Action.REFORM:
            agent.say(f"{agent.membership_news()}: re-forming the group (not counted as a "
                      "restart)")
        return Outcome(action)

    def _start_transition(self, waiting: int, leaving: int) -> None:
        news = (f"{leaving} node(s) leaving" if leaving else
                f"{waiting} node(s) waiting to join")
        self.agent.say(f"{news}: forming the next round in the background; the workers keep "
                       "training")
        self.transition = True
        self._unwatch()  # the transition watches from here on
        ctx, old, generation = self.agent.switch_context(), self.info, self.generation
        start_on_thread(lambda: member_transition(ctx, old, generation), self.agent.events,
                        "rdzv-transition", generation)

    def _recoverable(self) -> bool:
        """Whether a loss can be survived in-process: this node's workers use the API (the
        other nodes' are checked by group rank 0 of the next round)."""
        return self.agent.link.connected() and not self.agent.config.restart_on_change

    def _start_recovery(self, why: str) -> None:
        self.agent.say(f"{why}: aborting the group's collectives and forming the next round "
                       "without the lost node; the workers stay up")
        self.transition = True
        self._unwatch()
        ctx, old, generation = self.agent.switch_context(), self.info, self.generation
        start_on_thread(lambda: recovery_transition(ctx, old, generation), self.agent.events,
                        "rdzv-recovery", generation)

    def _on_transition_done(self, done: TransitionDone) -> Outcome | None:
        agent = self.agent
        self.transition = False
        if done.error is not None:
            agent.say(f"forming the next round failed ({type(done.error).__name__}: "
                      f"{done.error}); re-forming")
            return Outcome(Action.REFORM)
        if done.mode is Mode.IN_PROCESS and done.info is not None and done.assignment:
            newcomer = done.info is self.info  # a newcomer joined a running group: same round
            if not newcomer:  # a member switched (a newcomer joined: same round)
                self._unwatch()
                agent.adopt(self.group, done.assignment)
                self.info, self.assignment = done.info, done.assignment
                self._watch()
                what = "recovered in-process" if done.recovery else "switched"
                agent.say(f"{what} in {done.pause_ms or 0:.0f} ms at step {done.switch_step}: "
                          f"{agent.describe(done.assignment)}")
            else:
                agent.say(f"the workers joined the running group in {done.pause_ms or 0:.0f} ms "
                          f"at its step {done.switch_step}")
            record(agent.handler,
                   "recovered_in_process" if done.recovery else "switched_in_process",
                   step=done.switch_step, newcomer=newcomer or None,
                   pause_s=None if done.pause_ms is None else round(done.pause_ms / 1000, 6))
            agent.link.forget("switched", "broken", "missed", "failed")
            self._say_capable()
            return None
        agent.say(f"restarting the workers in the new round: {done.reason}")
        if done.switch_step is not None:  # some nodes may have switched: start over, all of us
            return Outcome(Action.REFORM)
        return Outcome(Action.REFORM, formed=done)

    # -- leaving ----------------------------------------------------------------------------
    def _on_signal(self, signum: int) -> Outcome | None:
        agent = self.agent
        name = signal.Signals(signum).name
        if (self._leaving is not None or self.transition or signum == signal.SIGHUP
                or self._finished_at is not None or self.info.world_size < 2):
            return Outcome(Action.STOP, signum)
        if self.info.world_size - 1 < agent.config.min_nodes:
            agent.say(f"{name} received: the other nodes cannot go on without this one (min "
                      f"nodes {agent.config.min_nodes}); stopping now")
            return Outcome(Action.STOP, signum)
        if hosts_store(self.info.store):
            agent.say(f"{name} received: this node serves the rendezvous store, which the "
                      "others need: it cannot leave gracefully (run `rdzv serve` apart); "
                      "stopping now")
            return Outcome(Action.STOP, signum)
        store, rank = self.info.store, self.assignment.group_rank
        try:
            store.set(f"{LEAVING_DIR}{rank}", json.dumps({"time": time.time(),
                                                          "host": agent.host}))
            announced = agent.handler.announce_leaving()
        except RendezvousError as exc:
            agent.say(f"cannot announce that this node leaves ({exc}); stopping now")
            return Outcome(Action.STOP, signum)
        if not announced:
            return Outcome(Action.STOP, signum)
        grace = agent.config.leave_grace
        self._leaving, self._leave_deadline = signum, time.monotonic() + grace
        agent.say(f"{name} received: leaving the job (grace {grace:g} s); the other nodes form "
                  f"the next round without this node while its workers keep training ({name} "
                  "again stops it at once)")
        info, generation, events = self.info, self.generation, agent.events

        def wait() -> None:
            try:
                decision = wait_for_switch(info, grace)
            except RendezvousError as exc:
                logger.warning("cannot learn whether the others moved on: %s", exc)
                decision = None
            events.put(LeaveNews(generation, decision))

        threading.Thread(target=wait, daemon=True, name="rdzv-leave").start()
        return None

    def _on_leave_news(self, decision: dict[str, Any] | None) -> Outcome | None:
        agent = self.agent
        assert self._leaving is not None
        if decision is None:
            return self._on_tick()
        link = agent.link
        if decision.get("restart") or not link.connected():
            agent.say("leaving: the other nodes formed the next round without this node; "
                      "exiting")
            self.group.stop(self._leaving, agent.config.stop_timeout)
            return Outcome(Action.LEFT)
        step = int(decision["step"])
        link.send_all(lambda lr: {"op": "plan", "leave": True})
        link.send_all(lambda lr: {"op": "switch", "step": step, "receivers": []})
        self._leave_step = step
        agent.say(f"leaving: the other nodes formed the next round without this node; its "
                  f"workers stop at step {step}")
        return None

    # -- helpers ----------------------------------------------------------------------------
    def _say_capable(self) -> None:
        """Tell the round that this node's workers can switch in-process."""
        if not self.agent.link.connected():
            return
        try:
            self.info.store.set(f"{CAPABLE_DIR}{self.assignment.group_rank}", b"1")
        except RendezvousError as exc:
            logger.warning("cannot record that the workers switch in-process: %s", exc)

    def _end_transition(self) -> TransitionDone | None:
        """Stop the workers of a failed group; if a transition runs, wait for its round."""
        agent = self.agent
        self.group.stop(timeout=agent.config.stop_timeout)
        agent.link.disconnect()
        if not self.transition:
            return None
        deadline = time.monotonic() + agent.config.switch_timeout + 2 * PROGRESS_INTERVAL
        while time.monotonic() < deadline:
            try:
                event = agent.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if isinstance(event, TransitionDone) and event.generation == self.generation:
                self.transition = False
                if event.error is None and event.switch_step is None and event.assignment:
                    return event
                return None
            if isinstance(event, Signalled):
                agent.events.put(event)
                return None
        return None

    def _watch(self) -> None:
        info = self.info
        self._watcher = MembershipWatcher(self.agent.handler, self.agent.events, self.generation,
                                          self.agent.config.monitor_interval,
                                          lambda: mark_alive(info),
                                          heartbeat_every(session_ttl(self.agent.config.rdzv_conf)))
        self._watcher.start()

    def _unwatch(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
