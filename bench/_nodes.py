"""Simulated nodes for the benches (``bench/rendezvous.py``, ``bench/agreement.py``).

Many nodes share a machine: they are spread over worker processes (:class:`Worker`, each running
the bench's own script with ``--worker SPEC``), and each node calls the library from its own
thread of control, all at one instant of CLOCK_MONOTONIC (shared by the processes of a machine;
:func:`at_once`). Up to ``GREENLETS_ABOVE`` nodes a node is an OS thread; above, a gevent
greenlet: the worker runs under ``python -m gevent.monkey`` (``pip install -e .[bench]``), so the
unmodified blocking library runs cooperatively, one greenlet per node. Thousands of OS threads per
process do not simulate nodes: they measure CPython's GIL (waiting threads wake every 5 ms to
claim it; at 10,000 nodes on 2 cores the load reached 1000 and the round never formed).

Each node has its own host address, as on a real cluster: node i's is a loopback address of its
own (:func:`node_addr`: 127.1.1.1, 127.1.1.2, ...), for what needs one (a port reserved for a
new group's store). With all 10,000 nodes on 127.0.0.1 the kernel's search for a free port among
10,000 reserved ones on one address took about 9 ms of CPU per reservation: a cost of the
simulation, not of a cluster, where each host reserves one port.

The store server is a real ``rdzv serve`` (``python -m rdzv serve``) in a process of its own
(:class:`ServerProcess`), which can count the requests it handled (its ``/metrics``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, Callable

HOST = "127.0.0.1"
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPLY_TIMEOUT = 600.0
"""The longest a driver waits for a worker's answer, and a worker for its nodes."""
GREENLETS_ABOVE = 1000
"""``--nodes auto``: nodes are greenlets above this many nodes, threads up to it."""
NODE_CHOICES = ("auto", "threads", "greenlets")


def node_addr(i: int) -> str:
    """Simulated node ``i``'s own loopback address (127.1.1.1, 127.1.1.2, ...)."""
    return f"127.{1 + i // 62500}.{(i // 250) % 250 + 1}.{i % 250 + 1}"


def split(total: int, procs: int) -> list[int]:
    """``total`` nodes over at most ``procs`` worker processes, as evenly as can be."""
    procs = max(1, min(procs, total))
    return [total // procs + (1 if i < total % procs else 0) for i in range(procs)]


def node_kind(n: int, choice: str, greenlets_ok: bool = True,
              threads_up_to: int = GREENLETS_ABOVE) -> str:
    """How the nodes of a run of ``n`` nodes are simulated: "threads" or "greenlets" (greenlets
    above ``threads_up_to`` for "auto", where ``greenlets_ok`` and gevent is installed)."""
    if choice != "auto":
        return choice
    if greenlets_ok and n > threads_up_to and importlib.util.find_spec("gevent") is not None:
        return "greenlets"
    return "threads"


def gevent_note(choice: str) -> str:
    """A note for the table when "auto" could not make nodes greenlets (else empty)."""
    if choice == "auto" and importlib.util.find_spec("gevent") is None:
        return (f"  note: gevent is not installed: nodes above {GREENLETS_ABOVE} ran as threads "
                "(pip install gevent)")
    return ""


def at_once(count: int, body: Callable[[int], None], at: float) -> None:
    """``body(i)`` for each of ``count`` nodes, each from its own thread (a greenlet in a
    worker under gevent), all at ``at`` (CLOCK_MONOTONIC); returns once every one returned, or
    after ``REPLY_TIMEOUT`` seconds. ``body`` reports its own errors."""

    def node(i: int) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        body(i)

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + REPLY_TIMEOUT
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


# -- worker processes ---------------------------------------------------------------------------
Handler = Callable[[dict[str, Any]], dict[str, Any]]
"""A worker's answer to each command of the driver."""


def parse_args(parser: argparse.ArgumentParser,
               worker_setup: Callable[[dict[str, Any]], Handler]) -> argparse.Namespace:
    """The bench's arguments, with ``--nodes`` and the hidden ``--worker SPEC``. With
    ``--worker`` this process is a worker and never returns: ``worker_setup(SPEC)`` creates its
    nodes and returns its handler, which answers every command line on stdin with one JSON line,
    until stdin closes."""
    parser.add_argument("--nodes", choices=NODE_CHOICES, default="auto",
                        help=f"how nodes are simulated: threads, gevent greenlets, or auto "
                             f"(greenlets above {GREENLETS_ABOVE} nodes if gevent is installed)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        threading.stack_size(256 * 1024)
        handle = worker_setup(json.loads(args.worker))
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            print(json.dumps(handle(json.loads(line))), flush=True)
        os._exit(0)  # keep-alive threads and 1000s of sockets: leave without teardown
    return args


class Worker:
    """A worker process running ``script --worker SPEC`` (under gevent for greenlet nodes)."""

    def __init__(self, script: str, spec: dict[str, Any]) -> None:
        greenlets = ["-m", "gevent.monkey"] if spec.get("nodes") == "greenlets" else []
        path = os.pathsep.join(p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, *greenlets, script, "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            # gevent runs the script with the working directory, not its own, on sys.path;
            # TORCH_CPP_LOG_LEVEL: torch's per-socket warnings
            env={**os.environ, "PYTHONPATH": path, "TORCH_CPP_LOG_LEVEL": "ERROR"},
        )

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.process.pid} exited ({self.process.poll()})")
        return json.loads(line)

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=30)


def start_workers(script: str, counts: list[int], **spec: Any) -> list[Worker]:
    """One worker per entry of ``counts``, hosting that many nodes (numbered on from the
    previous worker's: ``first``, ``count`` in its spec); returns once all are ready."""
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    workers = [Worker(script, {"count": c, "first": f, **spec}) for c, f in zip(counts, firsts)]
    try:
        for worker in workers:
            if worker.read() != {"ready": True}:
                raise RuntimeError(f"worker {worker.process.pid} did not start")
    except BaseException:
        for worker in workers:
            worker.close()
        raise
    return workers


def ask_all(workers: list[Worker], **command: Any) -> list[dict[str, Any]]:
    """Send ``command`` to every worker, then read every worker's answer."""
    for worker in workers:
        worker.send(**command)
    return [worker.read() for worker in workers]


# -- the store server ---------------------------------------------------------------------------
class ServerProcess:
    """``rdzv serve --host 127.0.0.1 --port 0`` in a process of its own; with ``metrics``, also
    its web view on a free loopback port, whose ``/metrics`` counts the requests it handled."""

    def __init__(self, metrics: bool = False) -> None:
        web = ["--web", f"{HOST}:0"] if metrics else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rdzv", "serve", "--host", HOST, "--port", "0", *web],
            stderr=subprocess.PIPE, text=True,
        )
        self.port = 0
        self.metrics_url = ""
        try:
            self._read_addresses(metrics)
        except BaseException:
            self.close()
            raise

    def _read_addresses(self, metrics: bool) -> None:
        stderr = self.process.stderr
        assert stderr is not None
        for line in stderr:  # ends when the process does
            found = re.search(r"listening on [^ ]+:(\d+)", line)
            self.port = int(found.group(1)) if found else self.port
            found = re.search(r"/metrics at (http://\S+)", line)
            self.metrics_url = found.group(1) + "metrics" if found else self.metrics_url
            if self.port and (self.metrics_url or not metrics):
                threading.Thread(target=stderr.read, daemon=True).start()  # drained from now on
                return
        raise RuntimeError(f"rdzv serve did not start (exit status {self.process.wait(30)})")

    def requests(self) -> int:
        """Requests the server has handled so far, all operations together."""
        with urllib.request.urlopen(self.metrics_url, timeout=60) as answer:
            text = answer.read().decode()
        return sum(int(float(n)) for n in re.findall(
            r"^rdzv_store_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE))

    def cpu_seconds(self) -> float:
        """The CPU time (user and system) the server process has used so far."""
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """Stop the server (SIGTERM: it stops cleanly), by its pid."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
