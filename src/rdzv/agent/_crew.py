"""A node's workers as its executor sees them: their processes (started together, one replaced
after a crash, stopped together), and the channel they speak on, whose messages are the
protocol's events only while the workers that sent them are the node's current ones."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from .._channel import STACKS_SIGNAL, ChannelServer, stacks_file
from .._messages import Abort, Entered, Hello, Plan, PlanKind, Probe, Stop
from ._host import NodeHost
from ._protocol import FromWorker
from ._records import Assignment
from ._workers import WorkerExited, WorkerGroup

logger = logging.getLogger(__name__)

SLOW_ENTRY_MS = 1000.0
"""A worker that took longer than this to enter a group: the console says where the time went."""
STACKS_WAIT = 1.0
"""Seconds the workers get to write their stacks."""


@dataclass(frozen=True)
class Said:
    """Event: a worker's message, on the channel connection of ``epoch`` (a message of a
    worker stopped since, on a connection forgotten since, is dropped)."""

    epoch: int
    local_rank: int
    message: Any


def _join_file(batch: int | None) -> str | None:
    """The file through which joiners started in ``batch`` (the protocol's number, the node's
    restart count) set up their provisional group, in the attempt's directory; None: alone."""
    return None if batch is None else f"join-{batch}.store"


class Crew:
    """This node's worker processes and the channel to them."""

    def __init__(self, agent: NodeHost) -> None:
        self._agent = agent
        self._epoch = 0
        self._incarnation = 0
        """Tags the exits of each worker group started (a stopped group's are dropped)."""
        self.group: WorkerGroup | None = None
        self._entered: dict[int, Entered] = {}
        self._pids: dict[int, int] = {}
        """Local rank -> the pid of the process that connected (it prepared its stack dump)."""
        self._link = ChannelServer(lambda lr, message: agent.events.put(
            Said(self._epoch, lr, message)))

    # -- what they say, how they end ------------------------------------------------------------
    def said(self, event: Said) -> FromWorker | None:
        """The protocol's event for a worker's message (None: a stopped worker's)."""
        if event.epoch != self._epoch:
            return None
        if isinstance(event.message, Entered):
            self._entered[event.local_rank] = event.message
        elif isinstance(event.message, Hello):
            self._pids[event.local_rank] = event.message.pid  # (it may not be the one started)
        return FromWorker(event.local_rank, event.message)

    def current(self, event: WorkerExited) -> bool:
        """Whether ``event`` is the exit of one of the current workers."""
        return self.group is not None and event.generation == self.group.generation

    def pause(self, local_ranks: tuple[int, ...]) -> tuple[float, str]:
        """The longest pause of the workers ``local_ranks`` entering their last group (ms), and
        how to say it: where the time went, if it was long (over ``SLOW_ENTRY_MS``)."""
        slowest = max((self._entered[lr] for lr in local_ranks if lr in self._entered),
                      key=lambda entered: entered.ms, default=None)
        if slowest is None:
            return 0.0, "0 ms"
        ms, took = slowest.ms, f"{slowest.ms:.0f} ms"
        if ms > SLOW_ENTRY_MS:
            took += (f" (creating the group {slowest.create_ms:.0f} ms, agreeing on the state "
                     f"{slowest.agree_ms:.0f} ms, the callbacks "
                     f"{ms - slowest.create_ms - slowest.agree_ms:.0f} ms)")
        return ms, took

    # -- processes ------------------------------------------------------------------------------
    def start(self, assignment: Assignment | None, restarts: int, stop_timeout: float) -> None:
        """Start every worker anew (the previous ones stopped first): with ``assignment``'s
        ranks, or (None) to join a running group in-process."""
        if self.group is not None:
            self.stop(signal.SIGTERM, stop_timeout)
        self._incarnation += 1
        self.group = self._agent.new_group(self._incarnation)
        self._forget()
        self._agent.start_workers(self.group, list(range(self._agent.config.nproc_per_node)),
                                  assignment, restarts, self._link.path,
                                  _join_file(restarts if assignment is None else None))

    def replace(self, local_rank: int, restarts: int, batch: int | None) -> None:
        """Start one worker again (its process died), to join the running group: with the
        node's other workers started to join in ``batch`` (one provisional group), or alone."""
        assert self.group is not None
        self._agent.start_workers(self.group, [local_rank], None, restarts, self._link.path,
                                  _join_file(batch))

    def stop(self, signum: int, timeout: float) -> None:
        """Stop every worker: API workers hear it on the channel first (a SIGTERM alone is
        their node's notice to leave), then the signal, then SIGKILL after ``timeout``."""
        if self.group is None:
            return
        for lr in self._link.connected():
            self._link.send(lr, Stop())
        self._forget()  # what they say from now on is no news
        self.group.stop(signum, timeout)
        self.group = None

    def renumber(self, assignment: Assignment) -> None:
        """The workers run on in-process in a new group: their ranks in the log lines."""
        if self.group is not None:
            self.group.renumber({lr: assignment.global_rank(lr)
                                 for lr in assignment.local_ranks})

    def _forget(self) -> None:
        self._epoch += 1
        self._pids.clear()
        self._link.forget()

    # -- messages -------------------------------------------------------------------------------
    def abort(self) -> None:
        for lr in self._link.connected():
            self._link.send(lr, Abort())

    def send_plans(self, plans: list[tuple[int, Plan]]) -> None:
        self._entered.clear()
        for lr, plan in plans:
            self._link.send(lr, plan)

    def probe(self, local_rank: int) -> None:
        self._link.send(local_rank, Probe())

    def stacks(self) -> dict[int, str]:
        """Every connected worker's Python stacks (all threads), by local rank: the process that
        connected writes them itself on :data:`STACKS_SIGNAL` (one that did not prepare for it
        is not asked: the signal's default action would end it)."""
        asked: dict[int, str] = {}
        for lr in sorted(self._link.connected()):
            path, pid = stacks_file(self._link.path, lr), self._pids.get(lr)
            try:
                if pid is None or not os.path.exists(path):
                    continue
                with open(path, "w"):  # empty it: a stack dumped before is no news
                    pass
                os.kill(pid, STACKS_SIGNAL)
                asked[lr] = path
            except OSError as exc:
                logger.warning("cannot ask local rank %d for its stacks: %s", lr, exc)
        sizes = dict.fromkeys(asked, -1)
        settled: set[int] = set()
        deadline = time.monotonic() + STACKS_WAIT
        while len(settled) < len(asked) and time.monotonic() < deadline:
            time.sleep(0.05)  # (a signal handler in native code writes them at once)
            for lr, path in asked.items():
                size = _size(path)
                if size and size == sizes[lr]:
                    settled.add(lr)
                sizes[lr] = size
        return {lr: _read(path) or "(the worker wrote no stack)" for lr, path in asked.items()}

    def kill(self, local_rank: int) -> None:
        """End one worker (and what it started) at once."""
        if self.group is not None:
            self.group.send_signal(local_rank, signal.SIGKILL)

    def send_leave(self, gen: int, step: int) -> None:
        for lr in self._link.connected():
            self._link.send(lr, Plan(round=gen, kind=PlanKind.LEAVE, step=step))

    def let_go(self, timeout: float) -> None:
        """The workers left the job: give them ``timeout`` s to finish and exit by themselves
        (last lines, a checkpoint) before :meth:`close` stops what is left."""
        if self.group is not None and not self.group.wait_exited(timeout):
            logger.warning("workers that left the job still run after %.3g s: stopping them",
                           timeout)

    def close(self, stop_timeout: float) -> None:
        self.stop(signal.SIGTERM, stop_timeout)
        self._link.close()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.read().rstrip()
    except OSError:
        return ""
