"""Real training jobs on this machine: ``examples/elastic_train.py`` under a launcher, one launcher
process per node on 127.0.0.1. Their command lines, their process trees read from /proc, signals
to a node's agent or to its whole tree, and stopping every process of a job by pid.

Shared by ``bench/membership.py`` and the training chaos soak (``tests/trainchaos/``); free of
pytest, so that the benchmarks can import it (a uniquely named module, as ``_launcher``).

Every process a job starts carries ``RDZV_TRAINING_JOB=<token>`` in its environment, which the
launchers pass on to their workers: together with the process trees seen while the job ran, that
finds every process of the job, also one that outlived its parent and was re-parented.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "elastic_train.py")
SHARDED_EXAMPLE = os.path.join(ROOT, "examples", "elastic_fsdp.py")
RDZV_FLAGS = {"rdzv": (), "rdzv-restart": ("--restart-on-change",),
              "rdzv-restart-preload": ("--restart-on-change", "--preload", "torch")}
"""The flags of each ``rdzv run`` launcher: ``rdzv`` changes membership in-process,
``rdzv-restart`` restarts the workers on every change, ``rdzv-restart-preload`` too but forks
them from a worker template that has imported torch."""
LAUNCHERS = (*RDZV_FLAGS, "torchrun-rdzv-tcp", "torchrun-c10d")
"""The ``rdzv run`` launchers, then torchrun with rdzv's plugin (``rdzv-tcp``) or with torch's
own ``c10d`` backend."""
CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
"""Rendezvous options of every launcher (torch's c10d takes whole seconds only: 1 s is its
fastest last call); a hung node is dropped after 3 s."""
MARKER = "RDZV_TRAINING_JOB"
KILL_WAIT = 30.0
"""Seconds a SIGKILLed launcher may take to be reaped on a loaded machine."""


def free_port() -> int:
    """A port free on 127.0.0.1 right now (a program started next may take it)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class JobSpec:
    """One training job: the launcher, its rendezvous and the example's workload."""

    launcher: str
    port: int
    """The rendezvous endpoint's port on 127.0.0.1."""
    nnodes: str = "1:3"
    run_id: str = "bench"
    max_restarts: int = 3
    hosted: bool = True
    """Whether node 0's launcher serves the rendezvous store (False: a separate ``rdzv serve``
    does, and no node hosts it)."""
    save_every: int = 10
    step_sleep: float = 0.05
    model_mb: float = 0.0
    checks: bool = False
    """Whether rank 0 also writes its parameter check after every change of group."""
    flags: tuple[str, ...] = ()
    """More flags of ``rdzv run`` (e.g. ``--replace-stragglers``)."""
    sharded: bool = False
    """Whether the job is ``examples/elastic_fsdp.py`` (HSDP) with two workers per node, not
    ``examples/elastic_train.py`` (DDP) with one."""

    @property
    def nproc(self) -> int:
        """Workers per node."""
        return 2 if self.sharded else 1

    @property
    def example(self) -> str:
        """The training script the workers run."""
        return SHARDED_EXAMPLE if self.sharded else EXAMPLE

    def command(self, node: int, work: str) -> list[str]:
        """Node ``node``'s launcher command line; its files go to ``work``."""
        is_host = str(self.hosted and node == 0).lower()
        common = ["--nnodes", self.nnodes, "--nproc-per-node", str(self.nproc), "--rdzv-id", self.run_id,
                  "--rdzv-endpoint", f"{HOST}:{self.port}", "--local-addr", HOST,
                  "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1",
                  "--rdzv-conf", f"{CONF},is_host={is_host}",
                  "--log-dir", os.path.join(work, f"logs{node}")]
        if self.launcher.startswith("rdzv"):
            head = [sys.executable, "-m", "rdzv.run", "--rdzv-backend", "tcp", "--stop-timeout", "5",
                    *RDZV_FLAGS[self.launcher], *self.flags]
        else:
            backend = "c10d" if self.launcher == "torchrun-c10d" else "rdzv-tcp"
            head = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", backend]
        checks = ["--checks", os.path.join(work, "checks.jsonl")] if self.checks else []
        return head + common + [
            self.example, "--steps", "1000000", "--checkpoint", os.path.join(work, "model.ckpt"),
            "--save-every", str(self.save_every), "--log-every", "1",
            "--progress", os.path.join(work, "progress.jsonl"),
            "--step-sleep", str(self.step_sleep), "--model-mb", str(self.model_mb)] + checks


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``pid``'s state letter, parent and kernel start time (which tells it apart from a later
    process reusing the pid); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def proc_start_time(pid: int) -> int | None:
    stat = proc_stat(pid)
    return None if stat is None else stat[2]


def descendants(root: int) -> list[int]:
    """Every live process under ``root`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat is not None:
                parents.setdefault(stat[1], []).append(int(name))
    found, todo = [], [root]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def carrying(marker: str) -> list[int]:
    """The live processes (zombies left out) whose environment holds ``marker`` (NAME=VALUE)."""
    needle = b"\0" + marker.encode() + b"\0"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                environ = b"\0" + handle.read() + b"\0"
        except OSError:
            continue
        stat = proc_stat(int(name))
        if needle in environ and stat is not None and stat[0] != "Z":
            found.append(int(name))
    return found


def send(pids: list[int], signum: int) -> None:
    """``signum`` to each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (the last one may be half written); [] without it."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle.read().split("\n")[:-1] if line]


class TrainingJob:
    """The processes of one job in ``work``: the launchers (one per node, ``nodes[i]``, logs in
    ``node<i>.log``) and any other program started with :meth:`spawn`. :meth:`kill_all` kills
    every process of the job by pid, also on an error or Ctrl-C."""

    def __init__(self, spec: JobSpec, work: str, env: dict[str, str] | None = None) -> None:
        self.spec, self.work = spec, work
        self.marker = f"{MARKER}={uuid.uuid4().hex}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    MARKER: self.marker.split("=", 1)[1], **(env or {})}
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.others: list[subprocess.Popen[bytes]] = []
        self.known: dict[int, tuple[int | None, int | None]] = {}
        """Every pid seen, directly started or not -> (its start time, its node or None)."""
        self.progress = os.path.join(work, "progress.jsonl")

    def spawn(self, command: list[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start ``command`` (not a node) in a session of its own, its output to ``log_name``."""
        self.others.append(self._popen(command, log_name, None))
        return self.others[-1]

    def _popen(self, command: list[str], log_name: str, node: int | None,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(os.path.join(self.work, log_name), "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=self.work,
                                       env={**self.env, **(env or {})}, start_new_session=True)
        self.known[process.pid] = (proc_start_time(process.pid), node)
        return process

    def start(self, env: dict[str, str] | None = None) -> float:
        """Start the next node (with ``hosted``, the first serves the store), with ``env`` added
        to its environment; the wall-clock instant of the spawn."""
        node = len(self.nodes)
        command = self.spec.command(node, self.work)
        spawned = time.time()
        self.nodes.append(self._popen(command, f"node{node}.log", node, env))
        return spawned

    def tree(self, node: int) -> list[int]:
        """Node ``node``'s launcher and every process under it now."""
        self.track()
        return [self.nodes[node].pid] + descendants(self.nodes[node].pid)

    def workers(self, node: int) -> list[int]:
        """The processes under node ``node``'s launcher that run the example (its workers; under
        ``--preload`` the worker template's command line names the example too, but its name
        is ``rdzv-template``)."""
        found = []
        for pid in descendants(self.nodes[node].pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    argv = handle.read().split(b"\0")
                with open(f"/proc/{pid}/comm") as handle:
                    name = handle.read().strip()
            except OSError:
                continue
            if self.spec.example.encode() in argv and name != "rdzv-template":
                found.append(pid)
        return found

    def signal_node(self, node: int, signum: int, whole_tree: bool) -> float:
        """``signum`` to node ``node``'s launcher, or to it and every process under it at once;
        the wall-clock instant it was sent."""
        pids = self.tree(node) if whole_tree else [self.nodes[node].pid]
        sent = time.time()
        send(pids, signum)
        return sent

    def track(self) -> None:
        """Remember every live descendant of the launchers, and whose it is (torchrun's and
        rdzv's workers run in sessions of their own, so a process group kill would miss them)."""
        for node, process in enumerate(self.nodes):
            for child in descendants(process.pid):
                if child not in self.known:
                    self.known[child] = (proc_start_time(child), node)

    def alive(self, node: int | None = None) -> list[int]:
        """The live processes of the job (zombies left out), or those seen under node ``node``:
        the pids seen that still run the same process, and, for the whole job, every process
        that carries the job's marker."""
        found = set()
        for pid, (started, owner) in self.known.items():
            stat = proc_stat(pid)
            if (node is None or owner == node) and stat and stat[2] == started and stat[0] != "Z":
                found.add(pid)
        if node is None:
            found.update(carrying(self.marker))
        return sorted(found)

    def entries(self) -> list[dict[str, Any]]:
        """Rank 0's progress so far."""
        return read_jsonl(self.progress)

    def kill_all(self) -> None:
        """SIGKILL every process of the job (resumed first, should one be stopped), and reap
        the processes started here."""
        self.track()
        pids = self.alive()
        send(pids, signal.SIGCONT)
        send(pids, signal.SIGKILL)
        for process in self.nodes + self.others:
            try:
                process.wait(KILL_WAIT)
            except subprocess.TimeoutExpired:
                logger.warning("pid %d still there %g s after SIGKILL", process.pid, KILL_WAIT)
