"""Agent speed: how fast ``rdzv run`` recovers from a failure and grows, side by side with torchrun.

Run: ``.venv/bin/python bench/agent.py [--reps 3] [--nproc 2] [--no-torch]``

Every launcher runs real agent processes on 127.0.0.1 (rdzv: ``python -m rdzv.run --rdzv-backend
tcp``; torchrun: ``python -m torch.distributed.run --rdzv-backend c10d``), each with ``--nproc``
workers. The workers write ``time.time()`` when they start (the processes share one clock).

* failure -> running: 2 agents (``--nnodes 2``, ``--max-restarts 1``). Once all workers run,
  global rank 1 exits with code 1; the time from just before its exit until the last worker of
  the restarted group has started.
* new node -> running: 2 agents (``--nnodes 2:3``) run; a third agent process is launched; the
  time from its launch until the last worker of the group of 3 has started (this includes the
  new agent's own start-up, e.g. importing torch for torchrun).

Each measurement is repeated ``--reps`` times; the median is shown, and the ratio torchrun/rdzv
(greater than 1: rdzv is faster). This machine is shared: absolute numbers vary with its load.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
TIMEOUT = 120.0
"""Seconds any one step may take before the trial is abandoned."""

WORKER = r'''
import os, sys, time
out = sys.argv[1]
rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # failures only, per node
stamp = time.time()
with open(os.path.join(out, f"start-{world}-{rank}-{os.getpid()}"), "w") as f:
    f.write(repr(stamp))
fail_flag = os.path.join(out, "fail-now")
deadline = time.monotonic() + 120
while time.monotonic() < deadline and not os.path.exists(os.path.join(out, "stop")):
    if rank == "1" and restart == "0" and os.path.exists(fail_flag):
        with open(os.path.join(out, "failed"), "w") as f:
            f.write(repr(time.time()))
        sys.exit(1)
    time.sleep(0.005)
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_command(kind: str, nnodes: str, nproc: int, port: int, run_id: str,
                     worker: str, out: str) -> list[str]:
    if kind == "rdzv":
        head = [sys.executable, "-m", "rdzv.run", "--rdzv-backend", "tcp",
                "--rdzv-conf", "last_call_timeout=1", "--local-addr", "127.0.0.1",
                "--log-dir", os.path.join(out, "logs"), "--stop-timeout", "5"]
    else:
        # no --local-addr: with it, torchrun 2.13's agents time out waiting for MASTER_ADDR
        # when a third node joins
        head = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d",
                "--rdzv-conf", "last_call_timeout=1"]
    return head + ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", "1",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                   "--monitor-interval", "0.1", worker, out]


class Trial:
    """One run of agents of one launcher, in a fresh directory; stops everything at the end."""

    def __init__(self, kind: str, nnodes: str, nproc: int, worker: str) -> None:
        self.kind = kind
        self.out = tempfile.mkdtemp(prefix=f"rdzv-bench-{kind}-")
        self.command = launcher_command(kind, nnodes, nproc, free_port(), "bench", worker,
                                        self.out)
        self.agents: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def start_agent(self) -> float:
        launched = time.time()
        log = open(os.path.join(self.out, f"agent{len(self.agents)}.log"), "wb")
        self.agents.append(subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True))
        log.close()
        return launched

    def starts(self, world: int, after: float) -> list[float]:
        paths = glob.glob(os.path.join(self.out, f"start-{world}-*"))
        stamps = []
        for path in paths:
            with open(path) as handle:
                text = handle.read()
            if text and float(text) > after:
                stamps.append(float(text))
        return stamps

    def wait_group(self, world: int, after: float) -> float:
        """The start time of the last worker of a group of ``world`` workers started after
        ``after`` (waits for it)."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            stamps = self.starts(world, after)
            if len(stamps) >= world:
                return max(stamps)
            if any(agent.poll() not in (None, 0) for agent in self.agents):
                break
            time.sleep(0.01)
        logs = "".join(open(os.path.join(self.out, f"agent{i}.log"), errors="replace").read()
                       for i in range(len(self.agents)))
        raise RuntimeError(f"{self.kind}: no group of {world} started "
                           f"within {TIMEOUT:g} s; agent output:\n{logs[-3000:]}")

    def touch(self, name: str) -> None:
        open(os.path.join(self.out, name), "w").close()

    def read_time(self, name: str) -> float:
        path = os.path.join(self.out, name)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as handle:
                    text = handle.read()
                if text:
                    return float(text)
            time.sleep(0.005)
        raise RuntimeError(f"{self.kind}: {name} was not written")

    def close(self) -> None:
        self.touch("stop")
        for agent in self.agents:
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, 9)
                agent.wait(10)
        shutil.rmtree(self.out, ignore_errors=True)


def failure_to_running(kind: str, nproc: int, worker: str) -> float:
    trial = Trial(kind, "2", nproc, worker)
    try:
        trial.start_agent()
        time.sleep(0.5)  # the first agent hosts the store
        trial.start_agent()
        trial.wait_group(2 * nproc, 0)
        time.sleep(0.5)
        trial.touch("fail-now")
        failed = trial.read_time("failed")
        return trial.wait_group(2 * nproc, failed) - failed
    finally:
        trial.close()


def join_to_running(kind: str, nproc: int, worker: str) -> float:
    trial = Trial(kind, "2:3", nproc, worker)
    try:
        trial.start_agent()
        time.sleep(0.5)
        trial.start_agent()
        trial.wait_group(2 * nproc, 0)
        time.sleep(0.5)
        launched = trial.start_agent()
        return trial.wait_group(3 * nproc, launched) - launched
    finally:
        trial.close()


def summarize(message: str) -> str:
    """The first line of a trial's error and the last error line of its agents' output."""
    lines = message.splitlines()
    errors = [line.strip() for line in lines if "Error" in line and ":" in line]
    return lines[0] + (f" (agents: {errors[-1]})" if errors else "")


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--no-torch", action="store_true", help="measure rdzv only")
    args = parser.parse_args()
    kinds = ["rdzv"] + (["torchrun"] if not args.no_torch and torch_available() else [])
    if "torchrun" not in kinds:
        print("torchrun not measured (torch not installed, or --no-torch)")
    with tempfile.NamedTemporaryFile("w", suffix="_worker.py", delete=False) as handle:
        handle.write(WORKER)
        worker = handle.name
    scenarios: list[tuple[str, Callable[[str, int, str], float]]] = [
        ("failure -> running (2 nodes)", failure_to_running),
        ("new node -> running (2 -> 3)", join_to_running),
    ]
    try:
        print(f"{args.nproc} workers per node, median of {args.reps}; seconds")
        header = f"{'scenario':32} " + " ".join(f"{k:>10}" for k in kinds)
        print(header + ("   torchrun/rdzv" if len(kinds) == 2 else ""))
        failures = []
        for name, measure in scenarios:
            medians: dict[str, float | None] = {}
            for kind in kinds:
                try:
                    samples = [measure(kind, args.nproc, worker) for _ in range(args.reps)]
                    medians[kind] = statistics.median(samples)
                except RuntimeError as exc:  # a launcher that never got there: say why
                    medians[kind] = None
                    failures.append(f"{kind}, {name}: {summarize(str(exc))}")
            row = f"{name:32} " + " ".join(
                f"{medians[k]:>10.3f}" if medians[k] is not None else f"{'failed':>10}"
                for k in kinds)
            if len(kinds) == 2:
                rdzv_s, torch_s = medians["rdzv"], medians["torchrun"]
                row += (f"   {torch_s / rdzv_s:>13.1f}x" if rdzv_s and torch_s
                        else f"   {'n/a':>14}")
            print(row, flush=True)
        for failure in failures:
            print(f"failed: {failure}")
    finally:
        os.unlink(worker)


if __name__ == "__main__":
    main()
