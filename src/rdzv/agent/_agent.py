"""The elastic agent of one node: rendezvous, start the workers, react to what happens, repeat.

Everything the agent waits for arrives as an event on one queue: a round formed (the
rendezvous runs in the background, ``next_rendezvous_async``), a worker exited, the membership
changed, a transition to a new round ended, a signal came. The decisions are pure functions
(``_grouprun.py``, ``_changes.py``) of what the agent observed; the loops carry them out: this
module's from round to round, :class:`GroupRun`'s while one group of workers runs (through
in-process switches to new rounds).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    SessionExpiredError,
    StoreTimeoutError,
)
from ..rendezvous import RendezvousHandler, RendezvousInfo
from ._config import LaunchConfig
from ._errors import WorkerFailure, failure_summary, read_error_file
from ._changes import Mode
from .._channel import ENV_CHANNEL, ENV_JOIN
from ._grouprun import PROGRESS_INTERVAL, Action, GroupRun, Outcome, Signalled
from ._history import MAX_FAILURES, failure_fields, record
from ._round import Assignment, assign, mark_done, wait_until_others_left
from ._transition import (
    ASSIGN_TIMEOUT,
    SwitchContext,
    TransitionDone,
    WorkerLink,
    newcomer_transition,
    start_on_thread,
    start_round,
)
from ._workers import WorkerGroup, WorkerSpec

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LEAVE_TIMEOUT = 30.0
"""Seconds the node serving the store waits for the others to leave a finished round."""
SPARE_CHECK = 1.0
"""Seconds between checks, while a round forms, whether this node waits as a spare."""


@dataclass(frozen=True)
class RoundFormed:
    """Event: the background rendezvous finished (its future holds the round or the error)."""

    future: "Future[RendezvousInfo]"


def worker_env(config: LaunchConfig, assignment: Assignment, local_rank: int, restarts: int,
               base: Mapping[str, str]) -> dict[str, str]:
    """The environment of one worker, with the variables torch's workers expect."""
    env = dict(base)
    nproc = config.nproc_per_node
    env.update(
        LOCAL_RANK=str(local_rank),
        RANK=str(assignment.rank_offset + local_rank),
        GROUP_RANK=str(assignment.group_rank),
        ROLE_RANK=str(assignment.role_rank_offset + local_rank),
        ROLE_NAME=config.role,
        LOCAL_WORLD_SIZE=str(nproc),
        WORLD_SIZE=str(assignment.world_size),
        GROUP_WORLD_SIZE=str(assignment.group_world_size),
        ROLE_WORLD_SIZE=str(assignment.role_world_size),
        MASTER_ADDR=assignment.master_addr,
        MASTER_PORT=str(assignment.master_port),
        TORCHELASTIC_RESTART_COUNT=str(restarts),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.run_id,
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )
    if nproc > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    return env


class ElasticAgent:
    """Runs the workers of one node under ``handler`` until they succeed, fail or are stopped.

    Args:
        config: the launch configuration.
        handler: the run's rendezvous handler (the agent shuts it down when it ends).
        host: this node's address for the workers' MASTER_ADDR and the failure report.
    """

    def __init__(self, config: LaunchConfig, handler: RendezvousHandler,
                 host: str | None = None) -> None:
        self.config = config
        self.handler = handler
        self.host = host or config.local_addr or socket.getfqdn()
        self.restarts = 0
        self.log_root = ""
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.generation = 0
        """Counts the rounds this node took part in; tags the events of each."""
        self._link: WorkerLink | None = None
        self._failures_before: list[WorkerFailure] = []
        """The failures that led to the round being joined now (empty after a re-form)."""
        self._paused: tuple[float, str] | None = None
        """Since when this node's training is paused (its workers stopped), and why."""

    # -- console ----------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        """Tell the person at the console what happens."""
        print(f"[rdzv {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    def describe(self, assignment: Assignment) -> str:
        last = assignment.rank_offset + self.config.nproc_per_node - 1
        return (f"{assignment.group_world_size} node(s), world size {assignment.world_size}; "
                f"this node is group rank {assignment.group_rank} with global ranks "
                f"{assignment.rank_offset}..{last}")

    # -- signals ----------------------------------------------------------------------------------
    @contextmanager
    def _signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.signal(signum, self._on_signal) for signum in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.events.put(Signalled(signum))  # SimpleQueue.put is safe in a signal handler

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends; returns the exit code for ``rdzv run``."""
        root = self.config.log_dir or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        self.log_root = tempfile.mkdtemp(prefix=f"{self.config.run_id}_", dir=root)
        self.say(f"worker logs: {self.log_root}")
        self._link = WorkerLink(self.events)
        with self._signals():
            try:
                return self._run()
            finally:
                self._link.close()
                self._shutdown_handler()

    @property
    def link(self) -> WorkerLink:
        assert self._link is not None, "the agent is not running"
        return self._link

    def switch_context(self) -> SwitchContext:
        config = self.config
        return SwitchContext(self.handler, self.link, config.nproc_per_node, config.role,
                             self.host, config.max_nodes, config.switch_timeout,
                             config.restart_on_change, self.say)

    def _run(self) -> int:
        config = self.config
        formed: TransitionDone | None = None
        while True:
            if formed is not None and formed.info is not None and formed.assignment is not None:
                info, assignment, plan = formed.info, formed.assignment, {"mode": "restart"}
                formed = None
            else:
                joined = self._join()
                if isinstance(joined, int):
                    return joined
                if joined is None:
                    continue
                info, assignment, plan = joined
            self.generation += 1
            self.say(f"round complete: {self.describe(assignment)}")
            joining = plan.get("mode") == Mode.IN_PROCESS.value
            try:
                group = self._start_workers(assignment, str(plan["prefix"]) if joining else None)
            except (OSError, RuntimeError) as exc:
                self.say(f"cannot start the workers: {exc}")
                self._give_up(info)
                return 1
            self._record_started(assignment, joining)
            if joining:
                ctx, generation = self.switch_context(), self.generation
                start_on_thread(lambda: newcomer_transition(ctx, info, assignment, generation),
                                self.events, "rdzv-join", generation)
            run = GroupRun(self, group, info, assignment, joining)
            outcome = run.run()
            code = self._after(outcome, group, run.info)
            if code is not None:
                return code
            formed = outcome.formed

    def _join(self) -> tuple[RendezvousInfo, Assignment, dict[str, Any]] | int | None:
        """Join the next round and take this node's place in it: (round, assignment, how the
        round starts), an exit code, or None to try again."""
        joining = time.monotonic()
        info = self._rendezvous()
        if isinstance(info, int):
            return info
        try:
            assignment = assign(info, self.handler, self.config.nproc_per_node, self.config.role,
                                self.host, ASSIGN_TIMEOUT, time.monotonic() - joining,
                                self.config.max_nodes)
            plan = start_round(self.switch_context(), info, assignment, None)
        except StoreTimeoutError as exc:
            self.say(f"a node of the new round did not answer ({exc}); re-forming")
            return None
        except SessionExpiredError as exc:  # (paused past its session ttl just now)
            self.say(f"this node's store session expired as the round formed, so the others "
                     f"take it for gone ({exc}); re-forming")
            return None
        except RendezvousError as exc:
            self.say(f"cannot share the worker counts of the new round: "
                     f"{type(exc).__name__}: {exc}")
            return 1
        return info, assignment, plan

    def _after(self, outcome: Outcome, group: WorkerGroup, info: RendezvousInfo) -> int | None:
        """Carry out how a group's run ended: an exit code, or None to go on to a new round."""
        config = self.config
        action = outcome.action
        if action is Action.SUCCEED:
            group.stop(timeout=config.stop_timeout)
            self._close("workers_succeeded")
            try:
                wait_until_others_left(info, LEAVE_TIMEOUT)
            except RendezvousError as exc:
                logger.warning("cannot wait for the other nodes to leave: %s", exc)
            self.say("every node has finished; this node's workers succeeded")
            return 0
        if action is Action.LEFT:
            group.stop(timeout=config.stop_timeout)
            return 0
        if action is Action.STOP:
            name = signal.Signals(outcome.signum).name
            self.say(f"{name} received: stopping the workers (grace {config.stop_timeout:g} "
                     "s) and leaving the rendezvous")
            group.stop(outcome.signum, config.stop_timeout)
            return 128 + outcome.signum
        failures = self._failures(group)
        self._paused = (min([f.time for f in failures] + [time.time()]),
                        "worker_failed" if action is not Action.REFORM else "membership_change")
        for failure in failures[:MAX_FAILURES]:
            record(self.handler, "worker_failed", **failure_fields(failure))
        group.stop(timeout=config.stop_timeout)
        self.link.disconnect()
        if action is Action.FAIL:
            reason = (f"workers failed after {self.restarts} restart(s) (--max-restarts "
                      f"{config.max_restarts})")
            print(failure_summary(failures, reason), file=sys.stderr, flush=True)
            self._give_up(info)
            return 1
        self._failures_before = failures if action is Action.RESTART else []
        if action is Action.RESTART:
            self.restarts += 1
            worst = failures[0] if failures else None
            why = (f"global rank {worst.global_rank} ended with {worst.how}" if worst
                   else "a worker failed")
            self.say(f"{why}; restarting the workers (restart {self.restarts} of "
                     f"{config.max_restarts})")
            record(self.handler, "workers_restarted", restarts=self.restarts,
                   max_restarts=config.max_restarts)
        return None
    def _rendezvous(self) -> RendezvousInfo | int:
        """Join the next round, reacting to signals meanwhile: the round or an exit code."""
        config = self.config
        self.say(f"waiting for nodes: {config.min_nodes}..{config.max_nodes} for run "
                 f"{config.run_id!r} ({config.rdzv_backend} {config.rdzv_endpoint})")
        started = said = time.monotonic()
        spare = False
        future = self.handler.next_rendezvous_async()
        future.add_done_callback(lambda f: self.events.put(RoundFormed(f)))
        while True:
            try:
                event = self.events.get(timeout=SPARE_CHECK)
            except queue.Empty:
                if self.handler.is_spare() != spare:
                    spare = not spare
                    if spare:
                        self.say(f"waiting as a spare: the job runs at its maximum of "
                                 f"{config.max_nodes} node(s); this node takes the place of one "
                                 "that leaves or is lost")
                if not spare and time.monotonic() - said >= PROGRESS_INTERVAL:
                    said = time.monotonic()
                    self.say(f"still waiting for nodes: {self._joined()}{config.min_nodes}.."
                             f"{config.max_nodes} ({time.monotonic() - started:.0f} s)")
                continue
            if isinstance(event, Signalled):
                self.say(f"{signal.Signals(event.signum).name} received while waiting for nodes: "
                         "leaving the rendezvous")
                return 128 + event.signum
            if isinstance(event, RoundFormed) and event.future is future:
                break
        try:
            info = future.result(timeout=0)
        except RendezvousGracefulExitError as exc:
            self.say(f"asked to leave the run: {exc}")
            return 0
        except RendezvousClosedError as exc:
            if spare and not self._failures_before:
                self.say("the job finished without needing this spare node")
                return 0
            if self._failures_before:
                reason = f"the workers cannot restart: the rendezvous is closed ({exc})"
                print(failure_summary(self._failures_before, reason), file=sys.stderr, flush=True)
            else:
                self.say(f"the rendezvous is closed, the run has ended on the other nodes ({exc})")
            return 1
        except RendezvousError as exc:
            self.say(f"rendezvous failed: {type(exc).__name__}: {exc}")
            return 1
        self.say(f"round formed in {time.monotonic() - started:.2f} s")
        return info

    def _start_workers(self, assignment: Assignment, join_prefix: str | None) -> WorkerGroup:
        """Start this node's workers; with ``join_prefix`` they join the running group."""
        config = self.config
        attempt_dir = os.path.join(self.log_root, f"attempt_{self.generation - 1}")
        channel = {ENV_CHANNEL: self.link.path}
        if join_prefix is not None:
            channel[ENV_JOIN] = join_prefix
        specs = [
            WorkerSpec(local_rank, assignment.rank_offset + local_rank,
                       worker_env(config, assignment, local_rank, self.restarts,
                                  {**os.environ, **channel}))
            for local_rank in range(config.nproc_per_node)
        ]
        self.link.reset(config.nproc_per_node, self.generation)

        def console_streams(local_rank: int) -> frozenset[str]:
            hidden = config.redirects.streams(local_rank) - config.tee.streams(local_rank)
            return frozenset({"stdout", "stderr"}) - hidden

        group = WorkerGroup(config.command, attempt_dir, self.events, self.generation,
                            console_streams)
        group.start(specs)
        pids = ", ".join(str(pid) for pid in group.pids().values())
        self.say(f"started {len(specs)} worker(s) (pids {pids}); logs in {attempt_dir}")
        return group

    def adopt(self, group: WorkerGroup, assignment: Assignment) -> None:
        """The running ``group`` switched in-process to the round of ``assignment``."""
        self.generation += 1
        group.renumber(self.generation, assignment.rank_offset)
        self.link.retag(self.generation)

    def mark_done(self, info: RendezvousInfo) -> None:
        try:
            mark_done(info)
        except RendezvousError as exc:
            logger.warning("cannot mark this node as finished: %s", exc)

    def _joined(self) -> str:
        """'k of ' nodes joined to the forming round (what num_nodes_waiting counts), or ''."""
        try:
            return f"{self.handler.num_nodes_waiting()} of "
        except RendezvousError:
            return ""

    def membership_news(self) -> str:
        try:
            waiting = self.handler.num_nodes_waiting()
        except RendezvousError:
            waiting = 0
        return f"{waiting} node(s) waiting to join" if waiting else "a node left or was lost"

    def _failures(self, group: WorkerGroup) -> list[WorkerFailure]:
        """The workers of ``group`` that have failed so far, earliest first."""
        failures = []
        for spec in group.specs:
            code = group.returncodes()[spec.local_rank]
            if code in (None, 0):
                continue
            logs, error_file = group.worker_files(spec.local_rank)
            failures.append(WorkerFailure(
                global_rank=spec.global_rank, local_rank=spec.local_rank, role=self.config.role,
                host=self.host, pid=group.pids()[spec.local_rank], exit_code=code,
                time=group.end_time(spec.local_rank) or time.time(), log_files=logs,
                error=read_error_file(error_file),
            ))
        return sorted(failures, key=lambda f: f.time)

    # -- ending ---------------------------------------------------------------------------------
    def _give_up(self, info: RendezvousInfo) -> None:
        """Close the rendezvous; count this node as finished so nobody waits for it."""
        self.mark_done(info)
        self._close("workers_failed")

    def _close(self, reason: str) -> None:
        try:
            self.handler.set_closed()
        except RendezvousError as exc:
            self.say(f"could not close the rendezvous: {exc}")
            return
        if getattr(self.handler, "closed_here", True):  # one node says so: the one that closed it
            record(self.handler, "run_closed", reason=reason)

    def _record_started(self, assignment: Assignment, joining: bool) -> None:
        """The history: the workers started, and how long training had paused before."""
        record(self.handler, "workers_started", nproc=self.config.nproc_per_node,
               group_rank=assignment.group_rank, world_size=assignment.world_size,
               restarts=self.restarts, joining=joining or None)
        if self._paused is not None:
            since, cause = self._paused
            self._paused = None
            record(self.handler, "training_paused", pause_s=round(time.time() - since, 6),
                   cause=cause)

    def _shutdown_handler(self) -> None:
        try:
            self.handler.shutdown()
        except RendezvousError as exc:
            logger.warning("leaving the rendezvous failed: %s", exc)
