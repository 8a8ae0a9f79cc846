"""Store speed: rdzv's TCPStore and store server against torch's TCPStore, side by side.

Run: ``.venv/bin/python bench/store.py [--ops 20000] [--rounds 3] [--waiters 1000] [--procs 4]
[--wake-rounds 5] [--no-torch]``

Both servers run in a process of their own (rdzv: ``python -m rdzv serve``; torch: a process
holding a master ``torch.distributed.TCPStore``, its C++ server), all on 127.0.0.1.

* throughput: one client in this process alternates ``set(key, 32 bytes)`` and ``get(key)``
  (rdzv pipelines the set, as torch does: both cost one round trip together); operations per
  second, and the CPU time the client and the server spend per set+get (less disturbed by a
  loaded machine than the rate). The implementations take turns for ``--rounds`` rounds and the
  best round of each is shown (this machine is shared: the best round is the least disturbed).
* wake-up: ``--waiters`` clients (one connection and one thread each, spread over ``--procs``
  processes) block in ``get("go<r>")``; once all are counted in (plus a settling second) this
  process calls ``set("go<r>")``. The time from the set until the last client returned
  (``time.time()`` is shared by the processes of one machine). The waiters of both
  implementations stay up for ``--wake-rounds`` rounds, taken in turns; the median is shown.
* flood fairness (rdzv only): ``--flood-conns`` connections (spread over ``--procs``
  processes) each keep ``--flood-depth`` non-blocking gets in flight (sent in one write, answers
  read, again), while one well-behaved client in this process does one ``get`` every 5 ms
  (``--flood-samples`` of them); its latency at the median and at worst, and the requests per
  second the flood got answered meanwhile. torch's client API has no pipelining, so there is
  no like-for-like torch flood; compare rdzv's trees (run this script from each checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, SRC)


# -- clients ------------------------------------------------------------------------------------
def rdzv_client(port: int, timeout: float = 120) -> Any:
    from rdzv.store import TCPStore

    return TCPStore("127.0.0.1", port, timeout=timeout)


def torch_client(port: int, timeout: float = 120) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )


CLIENTS: dict[str, Callable[..., Any]] = {"rdzv": rdzv_client, "torch": torch_client}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


# -- servers ------------------------------------------------------------------------------------
def start_rdzv_server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1", "--port", "0"],
        stderr=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"listening on [^ ]+:(\d+)", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, int(found.group(1))
    raise RuntimeError("the rdzv store server did not start")


TORCH_SERVER = """
import sys, time, torch.distributed as dist
from datetime import timedelta
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
print(store.port, flush=True)
sys.stdin.read()
"""


def start_torch_server() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", TORCH_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


SERVERS = {"rdzv": start_rdzv_server, "torch": start_torch_server}


# -- measurements --------------------------------------------------------------------------------
def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(impl: str, port: int, ops: int, server_pid: int) -> tuple[float, float, float]:
    """(ops/s, client CPU us per set+get, server CPU us per set+get) of one round."""
    store = CLIENTS[impl](port)
    value = b"x" * 32
    for _ in range(1000):
        store.set("warm", value)
        store.get("warm")
    pairs = ops // 2
    client_cpu = time.process_time()
    server_cpu = process_cpu_seconds(server_pid)
    started = time.perf_counter()
    for _ in range(pairs):
        store.set("key", value)
        store.get("key")
    elapsed = time.perf_counter() - started
    client_us = (time.process_time() - client_cpu) / pairs * 1e6
    server_us = (process_cpu_seconds(server_pid) - server_cpu) / pairs * 1e6
    if impl == "rdzv":
        store.close()
    return 2 * pairs / elapsed, client_us, server_us


def waiter_process(impl: str, port: int, count: int, rounds: int) -> None:
    """(In a child process) ``count`` clients block in get("go<r>") for each round r; report
    each round's last wake-up as one JSON line."""
    # (the other implementation's turns, and its slow start, pass while these wait)
    stores = [CLIENTS[impl](port, timeout=900) for _ in range(count)]
    woken: list[list[float]] = [[] for _ in range(rounds)]
    all_woken = [threading.Event() for _ in range(rounds)]
    lock = threading.Lock()

    def wait(store: Any) -> None:
        for r in range(rounds):
            store.add(f"ready{r}", 1)
            store.get(f"go{r}")
            now = time.time()
            with lock:
                woken[r].append(now)
                if len(woken[r]) == count:
                    all_woken[r].set()

    threads = [threading.Thread(target=wait, args=(s,), daemon=True) for s in stores]
    for thread in threads:
        thread.start()
    for r in range(rounds):
        all_woken[r].wait(300)
        print(json.dumps({"woken": len(woken[r]), "last": max(woken[r])}), flush=True)


class WakeUp:
    """``--waiters`` clients of one implementation, spread over ``--procs`` processes, that
    block in get("go<r>") round after round; :meth:`measure` releases one round."""

    def __init__(self, impl: str, port: int, waiters: int, procs: int, rounds: int) -> None:
        self.impl, self.waiters = impl, waiters
        self.main = CLIENTS[impl](port)
        share = [waiters // procs + (1 if i < waiters % procs else 0) for i in range(procs)]
        self.children = [
            subprocess.Popen(
                [sys.executable, __file__, "--_waiters", impl, str(port), str(n), str(rounds)],
                stdout=subprocess.PIPE,
                env=child_env(),
                text=True,
            )
            for n in share
            if n
        ]

    def measure(self, r: int) -> float:
        """Seconds from one set of "go<r>" until all waiters of round ``r`` returned."""
        deadline = time.monotonic() + 300
        while int(self.main.add(f"ready{r}", 0)) < self.waiters:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.impl}: the waiters did not all start")
            time.sleep(0.05)
        time.sleep(1.0)  # let the last get() reach its server
        started = time.time()
        self.main.set(f"go{r}", "now")
        last = 0.0
        woken = 0
        for child in self.children:
            assert child.stdout is not None
            report = json.loads(child.stdout.readline())
            woken += report["woken"]
            last = max(last, report["last"])
        if woken != self.waiters:
            raise RuntimeError(f"{self.impl}: {woken} of {self.waiters} waiters woke up")
        return last - started

    def close(self) -> None:
        for child in self.children:
            child.kill()
            child.wait()


def wake_ups(impls: list[str], waiters: int, procs: int, rounds: int) -> dict[str, list[float]]:
    """The wake-up times of each implementation in ``rounds`` rounds, taken in turns."""
    servers = {impl: SERVERS[impl]() for impl in impls}
    groups: dict[str, WakeUp] = {}
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    try:
        for impl in impls:
            groups[impl] = WakeUp(impl, servers[impl][1], waiters, procs, rounds)
        for r in range(rounds):
            for impl in impls:
                times[impl].append(groups[impl].measure(r))
    finally:
        for group in groups.values():
            group.close()
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()
    return times


def flood_process(port: int, conns: int, depth: int) -> None:
    """(In a child process) ``conns`` connections each keep ``depth`` gets in flight until this
    process's stdin closes; prints ``flooding`` once all are connected, then the answers read."""
    import select

    from rdzv.kv import protocol as P

    from rdzv.store import TCPStore

    stores = [TCPStore("127.0.0.1", port, timeout=120, session_ttl=0) for _ in range(conns)]
    stores[0].set("flood", b"x" * 32)
    stores[0].flush()
    for store in stores:  # handshaken; the flood bypasses the client API (and its keepalive)
        store._conn._lock.acquire()
    socks = [store._conn._sock for store in stores]
    batch = b"".join(P.encode_get(1_000_000 + i, b"flood", False) for i in range(depth))
    answer_size = len(P.ok(1, P.FOUND + b"x" * 32))
    pending = {sock.fileno(): 0 for sock in socks}
    by_fd = {sock.fileno(): sock for sock in socks}
    answered = 0
    print("flooding", flush=True)
    for sock in socks:
        sock.sendall(batch)
        pending[sock.fileno()] = depth * answer_size
    while True:
        ready, _, _ = select.select([*by_fd, sys.stdin], [], [], 1.0)
        if sys.stdin in ready:
            break
        for fd in ready:
            sock = by_fd[fd]
            got = len(sock.recv(1 << 20))
            pending[fd] -= got
            if pending[fd] <= 0:  # every answer of the batch read: the next batch
                answered += depth
                sock.sendall(batch)
                pending[fd] += depth * answer_size
    print(json.dumps({"answered": answered}), flush=True)


def flood_fairness(conns: int, depth: int, procs: int, samples: int) -> tuple[list[float], float]:
    """A healthy client's get latencies (s) while ``conns`` connections flood the server, and
    the flood's answered requests per second."""
    proc, port = start_rdzv_server()
    share = [conns // procs + (1 if i < conns % procs else 0) for i in range(procs)]
    flooders = [
        subprocess.Popen(
            [sys.executable, __file__, "--_flood", str(port), str(n), str(depth)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env(), text=True,
        )
        for n in share
        if n
    ]
    try:
        healthy = CLIENTS["rdzv"](port)
        healthy.set("healthy", b"y" * 32)
        for flooder in flooders:
            assert flooder.stdout is not None
            if flooder.stdout.readline().strip() != "flooding":
                raise RuntimeError("a flood process did not start")
        time.sleep(1.0)  # the flood under way
        latencies = []
        started = time.perf_counter()
        for _ in range(samples):
            t0 = time.perf_counter()
            if healthy.get("healthy") != b"y" * 32:
                raise RuntimeError("the healthy client got a wrong answer")
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.005)
        elapsed = time.perf_counter() - started
        answered = 0
        for flooder in flooders:
            assert flooder.stdin is not None and flooder.stdout is not None
            flooder.stdin.close()
            answered += json.loads(flooder.stdout.readline())["answered"]
        healthy.close()
        return latencies, answered / elapsed
    finally:
        for flooder in flooders:
            flooder.kill()
            flooder.wait()
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=20000, help="operations per throughput round")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per implementation")
    parser.add_argument("--waiters", type=int, default=1000, help="clients blocked in get")
    parser.add_argument("--procs", type=int, default=4, help="processes the waiters are spread over")
    parser.add_argument("--wake-rounds", type=int, default=5, help="wake-up rounds (median shown)")
    parser.add_argument("--flood-conns", type=int, default=50, help="flooding connections (0: no flood row)")
    parser.add_argument("--flood-depth", type=int, default=512, help="gets each flooding connection keeps in flight")
    parser.add_argument("--flood-samples", type=int, default=200, help="the healthy client's gets during the flood")
    parser.add_argument("--no-torch", action="store_true", help="measure rdzv only")
    parser.add_argument("--_waiters", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--_flood", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._waiters:
        impl, port, count, rounds = args._waiters
        waiter_process(impl, int(port), int(count), int(rounds))
        return
    if args._flood:
        port, conns, depth = map(int, args._flood)
        flood_process(port, conns, depth)
        return

    impls = ["rdzv"]
    if not args.no_torch:
        try:
            import torch  # noqa: F401

            impls.append("torch")
        except ImportError:
            print("torch is not installed: measuring rdzv only", file=sys.stderr)

    best: dict[str, float] = {}
    client_cpu: dict[str, float] = {}
    server_cpu: dict[str, float] = {}
    load_before = os.getloadavg()[0]
    wake_times = wake_ups(impls, args.waiters, args.procs, args.wake_rounds) if args.waiters else {}
    wake = {impl: statistics.median(times) for impl, times in wake_times.items()}
    flood: tuple[list[float], float] | None = None
    if args.flood_conns:
        flood = flood_fairness(args.flood_conns, args.flood_depth, args.procs, args.flood_samples)
    servers = {impl: SERVERS[impl]() for impl in impls}
    try:
        for _ in range(args.rounds):
            for impl in impls:
                proc, port = servers[impl]
                rate, client_us, server_us = throughput(impl, port, args.ops, proc.pid)
                best[impl] = max(best.get(impl, 0.0), rate)
                client_cpu[impl] = min(client_cpu.get(impl, float("inf")), client_us)
                server_cpu[impl] = min(server_cpu.get(impl, float("inf")), server_us)
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait()

    with_torch = "torch" in impls
    rows: list[tuple[str, dict[str, str], float | None]] = [
        (
            "set+get ops/s, 1 client",
            {i: f"{best[i]:,.0f}" for i in impls},
            best["rdzv"] / best["torch"] if with_torch else None,
        ),
        (
            "client CPU us per set+get",
            {i: f"{client_cpu[i]:.1f}" for i in impls},
            client_cpu["torch"] / client_cpu["rdzv"] if with_torch else None,
        ),
        (
            "server CPU us per set+get",
            {i: f"{server_cpu[i]:.1f}" for i in impls},
            server_cpu["torch"] / server_cpu["rdzv"] if with_torch else None,
        ),
    ]
    if wake:
        rows.append(
            (
                f"wake {args.waiters} blocked gets, ms (median)",
                {i: f"{wake[i] * 1000:,.1f}" for i in impls},
                wake["torch"] / wake["rdzv"] if with_torch else None,
            )
        )
    if flood is not None:
        latencies, rate = flood
        under = f"under a flood of {args.flood_conns}x{args.flood_depth}"
        for label, value in (
            (f"get ms {under}, p50", f"{statistics.median(latencies) * 1000:,.2f}"),
            (f"get ms {under}, max", f"{max(latencies) * 1000:,.2f}"),
            ("flood requests answered per s", f"{rate:,.0f}"),
        ):
            rows.append((label, {i: value if i == "rdzv" else "-" for i in impls}, None))
    header = f"{'':44s}" + "".join(f"{i:>12s}" for i in impls)
    if "torch" in impls:
        header += f"{'rdzv/torch':>14s}"
    print(header)
    for label, cells, ratio in rows:
        line = f"{label:44s}" + "".join(f"{cells[i]:>12s}" for i in impls)
        if ratio is not None:
            line += f"{ratio:>13.2f}x"
        print(line)
    for impl, times in wake_times.items():
        print(f"wake-up rounds, {impl}, ms: " + ", ".join(f"{t * 1000:.1f}" for t in times))
    if "torch" in impls:
        print("(ratio > 1: rdzv faster or cheaper; for times and CPU it is torch's / rdzv's)")
    print(
        f"machine: {os.cpu_count()} cores; Python {sys.version.split()[0]}; load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )


if __name__ == "__main__":
    main()
