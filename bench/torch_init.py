"""Time to a working torch process group: rdzv's launchers against torchrun with torch's c10d.

Run: ``.venv/bin/python bench/torch_init.py [--agents 2,4] [--nproc 1] [--repeat 3]``

For each number of local agents (nodes), the same job is launched three ways on 127.0.0.1:

* ``rdzv run``: rdzv's agent on rdzv's tcp backend;
* ``torchrun rdzv-tcp``: torch's agent on rdzv's tcp backend (the ``torchrun.handlers`` plugin);
* ``torchrun c10d``: torch's agent on torch's own c10d backend (the reference).

A time runs from the instant the agents are spawned until the last worker has returned from
``torch.distributed.init_process_group("gloo")`` (each worker writes that wall-clock instant to
a file); it includes starting Python, importing torch and the rendezvous. The median of
``--repeat`` runs is shown, with the ratio of torchrun c10d's time to each rdzv launcher's.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HOST = "127.0.0.1"
HERE = os.path.abspath(__file__)
RUN_TIMEOUT = 300.0
"""Seconds one launch may take before the bench gives up on it."""

LAUNCHERS = ("rdzv run", "torchrun rdzv-tcp", "torchrun c10d")


def worker(out_dir: str) -> None:
    """A worker: init the default process group, record the instant, leave."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    done = time.time()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}"), "w") as handle:
        handle.write(repr(done))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def agent_command(launcher: str, agents: int, nproc: int, out_dir: str, port: int) -> list[str]:
    common = [
        "--nnodes", str(agents), "--nproc-per-node", str(nproc), "--rdzv-id", "bench",
        "--rdzv-endpoint", f"{HOST}:{port}", "--local-addr", HOST, "--max-restarts", "0",
    ]
    script = [HERE, "--worker", out_dir]
    if launcher == "rdzv run":
        return [sys.executable, "-m", "rdzv.run", "--rdzv-backend", "tcp", *common, *script]
    backend = "rdzv-tcp" if launcher == "torchrun rdzv-tcp" else "c10d"
    return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", backend, "--monitor-interval", "0.1", *common, *script]


def launch_once(launcher: str, agents: int, nproc: int) -> float:
    """Seconds from spawning ``agents`` agents until every worker's process group is up."""
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-") as out_dir:
        command = agent_command(launcher, agents, nproc, out_dir, free_port())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        logs = [open(os.path.join(out_dir, f"agent{n}.log"), "w+b") for n in range(agents)]
        start = time.time()
        processes = [  # output to files: a full pipe would stall an agent and the whole job
            subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
            for log in logs
        ]
        deadline = time.monotonic() + RUN_TIMEOUT
        failures = []
        for process, log in zip(processes, logs):
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
            if process.returncode != 0:
                log.seek(0)
                failures.append(log.read().decode(errors="replace")[-3000:])
            log.close()
        if failures:
            raise RuntimeError(f"{launcher} with {agents} agents failed:\n{failures[0]}")
        times = []
        for name in os.listdir(out_dir):
            if not name.startswith("rank"):
                continue
            with open(os.path.join(out_dir, name)) as handle:
                times.append(float(handle.read()))
        if len(times) != agents * nproc:
            raise RuntimeError(f"{launcher}: {len(times)} of {agents * nproc} workers reported")
        return max(times) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", default="2,4", help="comma-separated numbers of local agents")
    parser.add_argument("--nproc", type=int, default=1, help="workers per agent")
    parser.add_argument("--repeat", type=int, default=3, help="launches per cell (median shown)")
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return

    print(f"launch -> every worker's init_process_group done (median of {args.repeat}), "
          f"{args.nproc} worker(s) per agent, {os.cpu_count()} CPU(s)\n")
    header = f"{'agents':>6} | " + " | ".join(f"{name:>17}" for name in LAUNCHERS)
    header += " | c10d / rdzv run | c10d / torchrun rdzv-tcp"
    print(header)
    print("-" * len(header))
    for agents in (int(n) for n in args.agents.split(",")):
        runs: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
        for _ in range(args.repeat):  # interleaved: background load hits every launcher alike
            for launcher in LAUNCHERS:
                runs[launcher].append(launch_once(launcher, agents, args.nproc))
        medians = {name: statistics.median(times) for name, times in runs.items()}
        reference = medians["torchrun c10d"]
        cells = " | ".join(f"{medians[name]:>15.2f} s" for name in LAUNCHERS)
        print(f"{agents:>6} | {cells} | {reference / medians['rdzv run']:>14.2f}x"
              f" | {reference / medians['torchrun rdzv-tcp']:>23.2f}x", flush=True)


if __name__ == "__main__":
    main()
