"""Rendezvous speed on etcd: rdzv's etcd backend against torch's etcd-v2 backend, same etcd.

Run: ``.venv/bin/python bench/rendezvous_etcd.py [--sizes 2,8,32,64,1000] [--no-torch]``
(torch's side needs ``torch`` and ``python-etcd``; it is skipped if they are missing).

One etcd 3.4 on 127.0.0.1 serves both (started with ``--enable-v2``, which torch's etcd-v2
backend needs). Every node is a thread with its own handler and its own etcd client (rdzv: an
EtcdStore with its lease; torch: a python-etcd client); the threads are spread over up to
``--procs`` worker processes (default 4). Handlers are created first; then every node calls
``next_rendezvous()`` at one instant of CLOCK_MONOTONIC (shared by the processes of a machine),
with min_nodes = max_nodes = N. A time is the latest return minus that instant; every round is
checked (ranks 0..N-1, one world size). torch is measured up to 64 nodes; a torch run that
fails (its etcd-v2 backend times out under load now and then) is retried and counted.

Beside the times: etcd's gRPC calls per node during rdzv's rounds (from etcd's ``/metrics``:
every request of the JSON gateway, watch and lease keep-alive streams included) and the CPU
seconds etcd used during each side's rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch's; not needed here

HOST = "127.0.0.1"
HERE = os.path.abspath(__file__)
REPLY_TIMEOUT = 600.0
TORCH_MAX_NODES = 64
TORCH_TRIES = 3


# -- worker processes ---------------------------------------------------------------------------
def _handler(spec: dict[str, Any]) -> Any:
    if spec["impl"] == "rdzv":
        from rdzv.rendezvous import RendezvousParameters, get_rendezvous_handler

        return get_rendezvous_handler(RendezvousParameters(
            "etcd", spec["endpoint"], spec["run_id"], spec["n"], spec["n"], local_addr=HOST,
            etcd_prefix="/bench-rdzv", read_timeout=REPLY_TIMEOUT, join_timeout=REPLY_TIMEOUT,
        ))
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    return get_rendezvous_handler(RendezvousParameters(
        "etcd-v2", spec["endpoint"], spec["run_id"], spec["n"], spec["n"], local_addr=HOST,
        join_timeout=REPLY_TIMEOUT,
    ))


def worker_main(spec: dict[str, Any]) -> None:
    """Create ``spec["count"]`` handlers, then run next_rendezvous on all at the given instant."""
    handlers = [_handler(spec) for _ in range(spec["count"])]
    print(json.dumps({"ready": True}), flush=True)
    at = json.loads(sys.stdin.readline())["at"]
    results: list[Any] = [None] * len(handlers)

    def one(i: int) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        try:
            info = handlers[i].next_rendezvous()
            results[i] = {"rank": info.rank, "world": info.world_size, "end": time.monotonic()}
        except Exception as exc:  # reported to the parent
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REPLY_TIMEOUT)
    print(json.dumps({"results": results}), flush=True)
    sys.stdin.readline()  # the parent's go-ahead to leave (all rounds are read)
    for handler in handlers:
        handler.shutdown()


class Worker:
    """A worker process and its JSON-line replies."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, HERE, "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.process.pid} exited ({self.process.wait(30)})")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send({})
                self.process.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(30)


def split(total: int, procs: int) -> list[int]:
    parts = min(total, procs)
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@dataclass(frozen=True)
class Run:
    seconds: float
    """From the common start until the last node returned its round."""
    calls: float
    """etcd gRPC calls per node meanwhile."""
    etcd_cpu: float
    """CPU seconds etcd used meanwhile."""


def etcd_calls(endpoint: str) -> int:
    """Every gRPC call etcd has started so far (the JSON gateway's requests among them)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=60).read().decode()
    return sum(int(float(n)) for n in re.findall(r"^grpc_server_started_total\{.*\} (\S+)$",
                                                  text, re.MULTILINE))  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def barrier(impl: str, endpoint: str, etcd_pid: int, n: int, procs: int) -> Run:
    """One round of ``n`` nodes, all asked to join at the same instant."""
    run_id = f"{impl}-{n}-{uuid.uuid4().hex[:8]}"
    workers = [Worker({"impl": impl, "endpoint": endpoint, "run_id": run_id, "n": n,
                       "count": count}) for count in split(n, procs)]  # fmt: skip
    try:
        for worker in workers:
            worker.reply()
        calls, cpu = etcd_calls(endpoint), cpu_seconds(etcd_pid)
        at = time.monotonic() + 0.5
        for worker in workers:
            worker.send({"at": at})
        results = [r for worker in workers for r in worker.reply()["results"]]
        calls, cpu = etcd_calls(endpoint) - calls, cpu_seconds(etcd_pid) - cpu
    finally:
        for worker in workers:
            worker.close()
    errors = [r["error"] for r in results if r is None or "error" in r]
    if errors:
        raise RuntimeError(f"{impl} N={n}: {len(errors)} node(s) failed, e.g. {errors[0]}")
    if sorted(r["rank"] for r in results) != list(range(n)) or {r["world"] for r in results} != {n}:
        raise RuntimeError(f"{impl} N={n}: inconsistent round {results}")
    return Run(max(r["end"] for r in results) - at, calls / n, cpu)


def torch_barrier(endpoint: str, etcd_pid: int, n: int, procs: int) -> tuple[Run, int]:
    """A torch round, retried when one fails; the run and how many runs failed before it."""
    for failed in range(TORCH_TRIES):
        try:
            return barrier("torch", endpoint, etcd_pid, n, procs), failed
        except RuntimeError as exc:
            print(f"  (torch N={n} failed: {str(exc)[:160]})", flush=True)
            if failed == TORCH_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def have_torch_etcd() -> bool:
    try:
        import etcd  # noqa: F401  (python-etcd)
        import torch.distributed.elastic.rendezvous.etcd_rendezvous_backend  # noqa: F401
    except ImportError:
        return False
    return True


def etcd_34_binary() -> str:
    """An etcd 3.4 binary (3.5 dropped the v2 API that torch's etcd-v2 backend uses)."""
    from rdzv.etcd import etcd_version, find_etcd_binaries

    for binary in find_etcd_binaries():
        if etcd_version(binary).startswith("3.4"):
            return binary
    raise SystemExit("needs etcd 3.4 (bash scripts/install-etcd installs Debian's etcd-server)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2,8,32,64,1000")
    parser.add_argument("--procs", type=int, default=4, help="worker processes per measurement")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size (median shown)")
    parser.add_argument("--no-torch", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    torch_ok = not args.no_torch and have_torch_etcd()
    if not args.no_torch and not torch_ok:
        print("torch or python-etcd missing: torch's etcd-v2 backend is skipped")

    from rdzv.etcd import LocalEtcd

    with LocalEtcd(binary=etcd_34_binary(), extra_args=["--enable-v2"]) as etcd:
        pid = etcd.pid(0)
        assert pid is not None
        print(f"etcd 3.4 at {etcd.endpoint} (--enable-v2, no other flag); {args.procs} worker "
              f"processes; median of {args.repeat} run(s); min_nodes = max_nodes = N\n")
        print(f"{'N':>6} | {'rdzv etcd':>10} | {'torch etcd-v2':>13} | {'speed-up':>8} | "
              f"{'rdzv calls/node':>15} | {'etcd CPU rdzv':>13} | {'etcd CPU torch':>14}")
        print("-|-".join("-" * w for w in (6, 10, 13, 8, 15, 13, 14)))
        for n in sizes:
            repeat = args.repeat if n <= 64 else 1
            ours = median_run([barrier("rdzv", etcd.endpoint, pid, n, args.procs)
                               for _ in range(repeat)])  # fmt: skip
            theirs, failures = None, 0
            if torch_ok and n <= TORCH_MAX_NODES:
                runs = [torch_barrier(etcd.endpoint, pid, n, args.procs) for _ in range(repeat)]
                theirs, failures = median_run([r for r, _ in runs]), sum(f for _, f in runs)
            shown = f"{theirs.seconds:12.3f}s" if theirs else f"{'-':>13}"
            ratio = f"{theirs.seconds / ours.seconds:7.1f}x" if theirs else f"{'-':>8}"
            their_cpu = f"{theirs.etcd_cpu:13.2f}s" if theirs else f"{'-':>14}"
            note = f"  ({failures} failed torch run(s) retried)" if failures else ""
            print(f"{n:>6} | {ours.seconds:9.3f}s | {shown} | {ratio} | {ours.calls:15.1f} | "
                  f"{ours.etcd_cpu:12.2f}s | {their_cpu}{note}", flush=True)


def median_run(runs: list[Run]) -> Run:
    """The run of median time (with its own counts)."""
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(json.loads(sys.argv[2]))
    else:
        main()
