"""The elastic agent of one node: rendezvous, start the workers, react to what happens, repeat.

Everything the agent waits for arrives as an event on one queue: a round formed (the
rendezvous runs in the background, ``next_rendezvous_async``), a worker exited, the membership
changed, a signal came. The decisions are pure functions (:func:`on_worker_exit`,
:func:`on_membership_change`) of what the agent observed; the loop carries them out.
"""

from __future__ import annotations

import enum
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
from ._round import (
    Assignment,
    MembershipChanged,
    MembershipWatcher,
    all_done,
    assign,
    mark_alive,
    mark_done,
    wait_until_others_left,
)
from ._workers import WorkerExited, WorkerGroup, WorkerSpec

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PROGRESS_INTERVAL = 10.0
"""Seconds between 'still waiting' messages while a round forms."""
ASSIGN_TIMEOUT = 60.0
"""Seconds a node waits for the other nodes of a formed round to exchange their worker counts."""
LEAVE_TIMEOUT = 30.0
"""Seconds the node serving the store waits for the others to leave a finished round."""
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
    LEAVE = "leave"


@dataclass(frozen=True)
class RoundFormed:
    """Event: the background rendezvous finished (its future holds the round or the error)."""

    future: "Future[RendezvousInfo]"


@dataclass(frozen=True)
class AllDone:
    """Event: every node of round ``generation`` has finished."""

    generation: int


@dataclass(frozen=True)
class Signalled:
    """Event: the agent received ``signum``."""

    signum: int


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
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._generation = 0
        self._failures_before: list[WorkerFailure] = []
        """The failures that led to the round being joined now (empty after a re-form)."""

    # -- console ----------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        """Tell the person at the console what happens."""
        print(f"[rdzv {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

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
        self._events.put(Signalled(signum))  # SimpleQueue.put is safe in a signal handler

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends; returns the exit code for ``rdzv run``."""
        root = self.config.log_dir or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        self.log_root = tempfile.mkdtemp(prefix=f"{self.config.run_id}_", dir=root)
        self.say(f"worker logs: {self.log_root}")
        with self._signals():
            try:
                return self._run()
            finally:
                self._shutdown_handler()

    def _run(self) -> int:
        config = self.config
        while True:
            joining = time.monotonic()
            info = self._rendezvous()
            if isinstance(info, int):
                return info
            self._generation += 1
            try:
                assignment = assign(info, self.handler, config.nproc_per_node, config.role,
                                    self.host, ASSIGN_TIMEOUT, time.monotonic() - joining)
            except StoreTimeoutError as exc:
                self.say(f"a node of the new round did not answer ({exc}); re-forming")
                continue
            except SessionExpiredError as exc:  # (paused past its session ttl just now)
                self.say(f"this node's store session expired as the round formed, so the "
                         f"others take it for gone ({exc}); re-forming")
                continue
            except RendezvousError as exc:
                self.say(f"cannot share the worker counts of the new round: "
                         f"{type(exc).__name__}: {exc}")
                return 1
            last = assignment.rank_offset + config.nproc_per_node - 1
            self.say(f"round complete: {assignment.group_world_size} node(s), world size "
                     f"{assignment.world_size}; this node is group rank {assignment.group_rank} "
                     f"with global ranks {assignment.rank_offset}..{last}")
            try:
                group = self._start_workers(assignment)
            except (OSError, RuntimeError) as exc:
                self.say(f"cannot start the workers: {exc}")
                self._give_up(info)
                return 1
            action, signum = self._monitor(group, info)
            if action is Action.SUCCEED:
                group.stop(timeout=config.stop_timeout)
                self._close()
                try:
                    wait_until_others_left(info, LEAVE_TIMEOUT)
                except RendezvousError as exc:
                    logger.warning("cannot wait for the other nodes to leave: %s", exc)
                self.say("every node has finished; this node's workers succeeded")
                return 0
            if action is Action.LEAVE:
                name = signal.Signals(signum).name
                self.say(f"{name} received: stopping the workers (grace {config.stop_timeout:g} "
                         "s) and leaving the rendezvous")
                group.stop(signum, config.stop_timeout)
                return 128 + signum
            failures = self._failures(group)
            group.stop(timeout=config.stop_timeout)
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
            else:
                self.say(f"{self._membership_news()}: re-forming the group (not counted as a "
                         "restart)")

    def _rendezvous(self) -> RendezvousInfo | int:
        """Join the next round, reacting to signals meanwhile: the round or an exit code."""
        config = self.config
        self.say(f"waiting for nodes: {config.min_nodes}..{config.max_nodes} for run "
                 f"{config.run_id!r} ({config.rdzv_backend} {config.rdzv_endpoint})")
        started = time.monotonic()
        future = self.handler.next_rendezvous_async()
        future.add_done_callback(lambda f: self._events.put(RoundFormed(f)))
        while True:
            try:
                event = self._events.get(timeout=PROGRESS_INTERVAL)
            except queue.Empty:
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

    def _start_workers(self, assignment: Assignment) -> WorkerGroup:
        config = self.config
        attempt_dir = os.path.join(self.log_root, f"attempt_{self._generation - 1}")
        specs = [
            WorkerSpec(local_rank, assignment.rank_offset + local_rank,
                       worker_env(config, assignment, local_rank, self.restarts, os.environ))
            for local_rank in range(config.nproc_per_node)
        ]

        def console_streams(local_rank: int) -> frozenset[str]:
            hidden = config.redirects.streams(local_rank) - config.tee.streams(local_rank)
            return frozenset({"stdout", "stderr"}) - hidden

        group = WorkerGroup(config.command, attempt_dir, self._events, self._generation,
                            console_streams)
        group.start(specs)
        pids = ", ".join(str(pid) for pid in group.pids().values())
        self.say(f"started {len(specs)} worker(s) (pids {pids}); logs in {attempt_dir}")
        return group

    def _monitor(self, group: WorkerGroup, info: RendezvousInfo) -> tuple[Action, int]:
        """Wait for the event that ends this group's run: (action, signal number if LEAVE).

        When this node's workers have all succeeded it waits, still watching the membership,
        until every node of the round has finished too.
        """
        generation = self._generation
        watcher = self._watch(generation, info)
        finished_at: float | None = None
        closed_seen = False
        try:
            while True:
                wait = PROGRESS_INTERVAL
                if finished_at is not None:
                    wait = finished_at + EXIT_BARRIER_TIMEOUT - time.monotonic()
                try:
                    event = self._events.get(timeout=max(0.0, wait))
                except queue.Empty:
                    if finished_at is None:
                        continue
                    self.say(f"not every node finished within {EXIT_BARRIER_TIMEOUT:g} s; "
                             "leaving anyway")
                    return Action.SUCCEED, 0
                if isinstance(event, Signalled):
                    return Action.LEAVE, event.signum
                if getattr(event, "generation", None) != generation:
                    continue  # an event of an earlier round
                if isinstance(event, WorkerExited):
                    if finished_at is not None:
                        continue  # the exit of a worker already counted in the success
                    codes = group.returncodes()
                    action = on_worker_exit(codes, self.restarts, self.config.max_restarts)
                    if action is Action.SUCCEED:
                        finished_at = time.monotonic()
                        self.say(f"all {len(codes)} worker(s) of this node succeeded; waiting "
                                 "for the other nodes to finish")
                        self._mark_done(info)
                        if closed_seen:  # the run is over: nobody re-forms any more
                            return Action.SUCCEED, 0
                        watcher.also_report(lambda: all_done(info), AllDone(generation))
                        continue
                elif isinstance(event, MembershipChanged):
                    closed = self.handler.is_closed() or all_done(info)
                    action = on_membership_change(closed, finished_at is not None)
                    if action is Action.CONTINUE:
                        closed_seen = True  # the watcher has ended: a closed run stays closed
                        self.say("the rendezvous was closed by another node; waiting for this "
                                 "node's workers to finish")
                elif isinstance(event, AllDone):
                    action = Action.SUCCEED
                else:
                    continue
                if action is not Action.CONTINUE:
                    return action, 0
        finally:
            watcher.stop()

    def _watch(self, generation: int, info: RendezvousInfo) -> MembershipWatcher:
        watcher = MembershipWatcher(self.handler, self._events, generation,
                                    self.config.monitor_interval, lambda: mark_alive(info))
        watcher.start()
        return watcher

    def _mark_done(self, info: RendezvousInfo) -> None:
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

    def _membership_news(self) -> str:
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
        self._mark_done(info)
        self._close()

    def _close(self) -> None:
        try:
            self.handler.set_closed()
        except RendezvousError as exc:
            self.say(f"could not close the rendezvous: {exc}")

    def _shutdown_handler(self) -> None:
        try:
            self.handler.shutdown()
        except RendezvousError as exc:
            logger.warning("leaving the rendezvous failed: %s", exc)
