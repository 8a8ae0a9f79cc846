"""The elastic agent of one node: its configuration, console, signals, and its workers' processes
and environment. What it does round after round is the node's protocol (``_protocol.py``,
``_rules.py``), carried out by ``_node.py``.
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
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from .._channel import ENV_CHANNEL, ENV_JOIN, ENV_JOIN_STORE
from .._clock import SYSTEM_CLOCK, Clock
from ..errors import RendezvousError
from ..rendezvous import RendezvousHandler
from ._config import LaunchConfig
from ._errors import WorkerFailure, read_error_file
from ._node import NodeRun
from ._protocol import Signalled
from ._records import Assignment
from ._template import WorkerTemplate
from ._workers import WorkerGroup, WorkerSpec, popen

logger = logging.getLogger(__name__)

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TEMPLATE_POLL = 0.1
"""Seconds between looks for a signal while the node waits for its worker template."""
SIGNALLED_LEAVE = 3.0
"""Seconds a node stopped by a signal gives leaving the rendezvous before it exits anyway."""


def worker_env(config: LaunchConfig, assignment: Assignment | None, local_rank: int,
               restarts: int, base: Mapping[str, str],
               join_store: str | None = None) -> dict[str, str]:
    """The environment of one worker, with the variables torch's workers expect.

    Without ``assignment`` the worker joins a running group in-process: its rank, world size
    and master come from its agent's plan (``rdzv.torch.init_process_group`` sets them then);
    ``join_store``: every worker of the node joins, and they share that file as the store of a
    provisional group of their own until then.
    """
    env = threads_env(config, base)
    env.update(
        LOCAL_RANK=str(local_rank),
        ROLE_NAME=config.role,
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        TORCHELASTIC_RESTART_COUNT=str(restarts),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.run_id,
        TORCHELASTIC_USE_AGENT_STORE="False",
        TORCH_NCCL_ASYNC_ERROR_HANDLING=base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )
    env.pop(ENV_JOIN_STORE, None)
    if assignment is None:
        env[ENV_JOIN] = "1"
        if join_store is not None:
            env[ENV_JOIN_STORE] = join_store
        for name in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                     "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
    else:
        env.pop(ENV_JOIN, None)
        env.update(
            RANK=str(assignment.rank_offset + local_rank),
            GROUP_RANK=str(assignment.group_rank),
            ROLE_RANK=str(assignment.role_rank_offset + local_rank),
            WORLD_SIZE=str(assignment.world_size),
            GROUP_WORLD_SIZE=str(assignment.group_world_size),
            ROLE_WORLD_SIZE=str(assignment.role_world_size),
            MASTER_ADDR=assignment.master_addr,
            MASTER_PORT=str(assignment.master_port),
        )
    return env


def threads_env(config: LaunchConfig, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the thread count of a node's workers (``OMP_NUM_THREADS=1`` when it runs
    more than one worker, unless set): the environment of its worker template too, since
    OpenMP reads it when torch is imported."""
    env = dict(base)
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    return env


def say(message: str) -> None:
    """Tell the person at the console of ``rdzv run`` what happens (one line, timed)."""
    print(f"[rdzv {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class ElasticAgent:
    """Runs the workers of one node under ``handler`` until they succeed, fail or are stopped.

    Args:
        config: the launch configuration.
        handler: the run's rendezvous handler (the agent shuts it down when it ends).
        host: this node's address for the workers' MASTER_ADDR and the failure report.
        clock: the time the node's decisions are taken at (the system's; tests move their own).
    """

    def __init__(self, config: LaunchConfig, handler: RendezvousHandler,
                 host: str | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock
        self.handler = handler
        self.host = host or config.local_addr or socket.getfqdn()
        self.log_root = ""
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._attempts = 0
        self.started = clock.time()
        """When this agent started (wall time: what ``rdzv status`` shows as *up*)."""
        self.store_gone = False
        """The rendezvous store could not be reached for its whole timeout."""
        self.signals = 0
        """How many signals asked this node to leave or stop (scancel, a preemption, Ctrl-C...):
        a wait that a new one ends compares counts."""
        self.template: WorkerTemplate | None = None
        """The worker template (``--preload``) the workers are forked from, while it runs."""

    # -- console ----------------------------------------------------------------------------------
    def say(self, message: str) -> None:
        """Tell the person at the console what happens."""
        say(message)

    def describe(self, assignment: Assignment) -> str:
        ranks = (f"global ranks {assignment.rank_offset}.."
                 f"{assignment.rank_offset + len(assignment.local_ranks) - 1}"
                 if assignment.local_ranks else "no worker in the group yet")
        return (f"{assignment.group_world_size} node(s), world size {assignment.world_size}; "
                f"this node is group rank {assignment.group_rank} with {ranks}")

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
        self.signals += 1
        self.events.put(Signalled(signum))  # SimpleQueue.put is safe in a signal handler

    # -- running ----------------------------------------------------------------------------------
    def run(self) -> int:
        """Run until the job ends; returns the exit code for ``rdzv run``."""
        root = self.config.log_dir or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        self.log_root = tempfile.mkdtemp(prefix=f"{self.config.run_id}_", dir=root)
        self.say(f"worker logs: {self.log_root}")
        with self._signals():
            try:
                self._open_template()
                node = NodeRun(self)
                try:
                    return node.run()
                finally:
                    node.close()
            finally:
                if self.template is not None:
                    self.template.close()
                self._shutdown_handler()

    def _open_template(self) -> None:
        """Start the worker template of ``--preload`` and wait for its imports (at most
        ``--worker-connect-timeout``, or until a signal) before the node joins: once in a round,
        its workers start at once. A newcomer whose workers still had to import would hold
        every node's restart under ``--restart-on-change`` (and torchrun's) for that long."""
        if not self.config.preload:
            return
        template = self.template = WorkerTemplate(
            self.config.command, self.config.preload, threads_env(self.config, os.environ),
            self.say, self.config.worker_connect_timeout)
        template.open()
        modules = ", ".join(self.config.preload)
        self.say(f"worker template (pid {template.pid}) imports {modules}; the workers are "
                 "forked from it")
        began = self.clock.monotonic()
        deadline = began + self.config.worker_connect_timeout
        while not template.settled(TEMPLATE_POLL) and not self.signals \
                and self.clock.monotonic() < deadline:
            pass
        if template.usable():
            self.say(f"worker template ready in {self.clock.monotonic() - began:.2f} s")

    def start_workers(self, group: WorkerGroup, local_ranks: list[int],
                      assignment: Assignment | None, restarts: int, channel_path: str,
                      together: str | None = None) -> None:
        """Start the workers ``local_ranks`` in ``group``: with ``assignment``'s ranks, or
        (None) to join a running group in-process; they speak to the agent on ``channel_path``.
        ``together``: every worker of the node joins, set up first in a provisional group of
        theirs whose store is the file of that name (in the attempt's directory)."""
        channel = {ENV_CHANNEL: channel_path}
        join_store = os.path.join(group.attempt_dir, together) if together else None
        specs = [WorkerSpec(lr, assignment.rank_offset + lr if assignment else -1,
                            worker_env(self.config, assignment, lr, restarts,
                                       {**os.environ, **channel}, join_store))
                 for lr in local_ranks]
        group.start(specs)
        pids = ", ".join(str(group.pids()[lr]) for lr in local_ranks)
        joining = " to join the running group" if assignment is None else ""
        self.say(f"started {len(specs)} worker(s) (pids {pids}){joining}; logs in "
                 f"{group.attempt_dir}")

    def new_group(self, generation: int) -> WorkerGroup:
        """An empty worker group whose exits are tagged ``generation``; its logs in a new
        ``attempt_<n>`` directory."""
        config = self.config
        attempt_dir = os.path.join(self.log_root, f"attempt_{self._attempts}")
        self._attempts += 1

        def console_streams(local_rank: int) -> frozenset[str]:
            hidden = config.redirects.streams(local_rank) - config.tee.streams(local_rank)
            return frozenset({"stdout", "stderr"}) - hidden

        starter = self.template.start_worker if self.template is not None else popen
        return WorkerGroup(config.command, attempt_dir, self.events, generation, console_streams,
                           starter)

    def failure(self, group: WorkerGroup, local_rank: int, code: int) -> WorkerFailure:
        """What is known of a worker that failed: rank, exit, error file, logs."""
        logs, error_file = group.worker_files(local_rank)
        spec = next(s for s in group.specs if s.local_rank == local_rank)
        return WorkerFailure(
            global_rank=spec.global_rank, local_rank=local_rank, role=self.config.role,
            host=self.host, pid=group.pids()[local_rank], exit_code=code,
            time=group.end_time(local_rank) or time.time(), log_files=logs,
            error=read_error_file(error_file))

    def _shutdown_handler(self) -> None:
        """Leave the rendezvous. After a signal, at most :data:`SIGNALLED_LEAVE` seconds: the
        sender (Slurm's scancel, a preemption) waits for this process to end, and a store gone
        with the other nodes of a cancelled job would hold it for the whole ``close_timeout``
        (the peers see this node's session end anyway)."""
        if self.store_gone:  # leaving would only wait on it, for its timeout
            return
        if not self.signals:
            self._leave()
            return
        leaving = threading.Thread(target=self._leave, name="rdzv-leave", daemon=True)
        leaving.start()
        leaving.join(SIGNALLED_LEAVE)
        if leaving.is_alive():
            self.say(f"the rendezvous store did not answer within {SIGNALLED_LEAVE:g} s while "
                     "this node left it; exiting without waiting for it")

    def _leave(self) -> None:
        try:
            self.handler.shutdown()
        except RendezvousError as exc:
            logger.warning("leaving the rendezvous failed: %s", exc)
