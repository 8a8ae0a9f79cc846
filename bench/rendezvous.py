"""Rendezvous speed: rdzv's tcp backend against torch's c10d backend, side by side.

Run: ``.venv/bin/python bench/rendezvous.py [--sizes 2,8,32,128,1000,10000] [--repeat 5]
[--no-torch]``

How nodes are simulated (``bench/_nodes.py``): every node has its own handler and its own store
connection (rdzv: a TCPStore client with its session; torch: a TCPStore client), and calls
next_rendezvous from its own thread of control; the nodes are spread over ``--procs`` worker
processes (default 8), all on 127.0.0.1. Each node has its own host address (node i's
``local_addr`` is a loopback address of its own, 127.1.1.1, 127.1.1.2, ...), on which rdzv
reserves the port of the round's bootstrap store (torch only uses it as the node's name). Up to
1000 nodes (``--nodes auto``) each node is an OS thread; above that rdzv's nodes are gevent
greenlets (``pip install -e .[bench]`` installs gevent). torch's TCPStore client is C++ (gevent
cannot switch inside it), so torch's nodes are always threads; torch only runs up to 128 nodes.
rdzv's store server is ``rdzv serve`` in its own process; torch's TCPStore server (C++) runs in
this one. Workers start their nodes at one instant of CLOCK_MONOTONIC and report when their last
node returned; a time is the latest return minus the start. "last call" is when the last node
had made its call (how far the simulation lagged behind the common start; it is part of the time).

Scenarios:

* barrier: N nodes call next_rendezvous together, min_nodes = max_nodes = N. ``--repeat``
  rounds per size, each with a fresh server and fresh nodes, rdzv and torch in turns; the
  median is shown (a single round on this shared 2-core machine is noisy), with rdzv's slowest.
* scale-out: 8 members formed a round (max_nodes 9); a late node calls next_rendezvous. "seen"
  is the time until a member notices it (rdzv: wait_for_membership_change returns; torch:
  num_nodes_waiting() > 0, polled every millisecond); "new round" is the time from the members
  calling next_rendezvous until all 8 returned in a round of 9 (the late node's own return is
  checked, and reported if it fails).
* failure: 8 members (7 threads in one process, 1 in another, min 2, max 8) formed a round; the
  lone process is SIGKILLed. Time until the 7 survivors completed a new round, default timeouts
  (rdzv: survivors learn of the death from wait_for_membership_change; torch has no such call,
  so its survivors call next_rendezvous at once, which only favours torch).

torch is skipped above 128 nodes: its c10d backend did not finish at 256 (every node rewrites
one shared state value with compare-and-set, retrying on conflicts).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import select
import signal
import time
import warnings
from typing import Any

from _nodes import (
    HOST,
    Handler,
    ServerProcess,
    Worker,
    ask_all,
    at_once,
    gevent_note,
    node_addr,
    node_kind,
    parse_args,
    split,
)
from _nodes import start_workers as start_node_workers

HERE = os.path.abspath(__file__)


# -- worker processes ---------------------------------------------------------------------------
def _rdzv_handler(spec: dict[str, Any]) -> Any:
    from rdzv.rendezvous import RendezvousParameters, get_rendezvous_handler

    options = {"is_host": False, **spec.get("options", {})}
    return get_rendezvous_handler(RendezvousParameters(
        "tcp", f"{HOST}:{spec['port']}", spec["run_id"], spec["min"], spec["max"],
        local_addr=spec["addr"], **options,
    ))


def _torch_handler(spec: dict[str, Any]) -> Any:
    from datetime import timedelta

    warnings.filterwarnings("ignore")
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    store = TCPStore(HOST, spec["port"], is_master=False, timeout=timedelta(seconds=600))
    backend = C10dRendezvousBackend(store, spec["run_id"])
    timeout = RendezvousTimeout(**{k: timedelta(seconds=v) for k, v in spec.get("timeouts", {}).items()})
    return DynamicRendezvousHandler.from_backend(
        spec["run_id"], store, backend, spec["min"], spec["max"], local_addr=spec["addr"],
        timeout=timeout,
    )


def _next_all(handlers: list[Any], at: float) -> dict[str, Any]:
    """Every handler calls next_rendezvous at ``at``, each from its own thread.

    Reports the latest return, each node's (rank, world size), the first errors, and the latest
    moment a node made its call (how far the simulation lagged behind the common start).
    """
    starts = [0.0] * len(handlers)
    ends = [0.0] * len(handlers)
    ranks: list[Any] = [None] * len(handlers)
    errors: list[str] = []

    def node(i: int) -> None:
        starts[i] = time.monotonic()
        try:
            info = handlers[i].next_rendezvous()
            ranks[i] = (info.rank, info.world_size)
        except Exception as exc:  # reported in the table
            errors.append(f"{type(exc).__name__}: {exc}")
        ends[i] = time.monotonic()

    at_once(len(handlers), node, at)
    return {"end": max(ends), "last_call": max(starts), "ranks": ranks, "errors": errors[:3]}


def _watch(handler: Any, impl: str) -> float:
    if impl == "rdzv":
        if not handler.wait_for_membership_change(120.0):
            raise TimeoutError("no membership change within 120 s")
        return time.monotonic()
    deadline = time.monotonic() + 120.0
    while handler.num_nodes_waiting() == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("no waiting node within 120 s")
        time.sleep(0.001)
    return time.monotonic()


def worker_setup(spec: dict[str, Any]) -> Handler:
    """A worker's nodes (one handler each) and its command handler."""
    make = _rdzv_handler if spec["impl"] == "rdzv" else _torch_handler
    handlers = [make({**spec, "addr": node_addr(spec["first"] + i)}) for i in range(spec["count"])]

    def handle(command: dict[str, Any]) -> dict[str, Any]:
        if command["op"] == "next":
            return _next_all(handlers, command["at"])
        return {"seen": _watch(handlers[0], spec["impl"])}

    return handle


# -- the driver ---------------------------------------------------------------------------------
class Server:
    """rdzv's store server in a process (``rdzv serve``), or torch's TCPStore server in this one."""

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.process: ServerProcess | None = None
        if impl == "rdzv":
            self.process = ServerProcess()
            self.port = self.process.port
        else:
            from datetime import timedelta

            warnings.filterwarnings("ignore")
            from torch.distributed import TCPStore

            self.store = TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=600),
                                  wait_for_workers=False)
            self.port = self.store.port

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
        else:
            del self.store


def start_workers(impl: str, port: int, counts: list[int], **spec: Any) -> list[Worker]:
    return start_node_workers(HERE, counts, impl=impl, port=port, **spec)


def next_round(workers: list[Worker], lead: float = 0.5) -> tuple[float, list[Any], float]:
    """Every node of ``workers`` calls next_rendezvous at one instant.

    Returns (seconds until the last node returned, every node's result, seconds until the last
    node had made its call).
    """
    at = time.monotonic() + lead
    results = ask_all(workers, op="next", at=at)
    errors = [e for r in results for e in r["errors"]]
    if errors:
        raise RuntimeError(f"next_rendezvous failed: {errors[0]}")
    return (max(r["end"] for r in results) - at, [x for r in results for x in r["ranks"]],
            max(r["last_call"] for r in results) - at)


def check(ranks: list[Any], world: int) -> None:
    """Distinct ranks below ``world`` (all of them if every node is listed), one world size."""
    assert None not in ranks, ranks
    got = sorted(r for r, _ in ranks)
    assert len(set(got)) == len(got) and got[-1] < world and len(got) >= world - 1, ranks
    assert {w for _, w in ranks} == {world}


def bench_barrier(impl: str, n: int, procs: int, run: int, nodes: str) -> tuple[float, float]:
    """(seconds until the last of N nodes returned, seconds until the last had made its call)."""
    server = Server(impl)
    # Above 1000 nodes the saturated cores can delay a client's keepalive during setup: a longer
    # heartbeat keeps the simulated nodes' sessions alive.
    options = {"heartbeat_interval": 60.0} if n > 1000 else {}
    workers = start_workers(impl, server.port, split(n, procs), run_id=f"barrier{run}",
                            min=n, max=n, options=options, timeouts={}, nodes=nodes)
    try:
        seconds, ranks, last_call = next_round(workers, lead=0.5 + n / 5000)
        assert len(ranks) == n, f"{len(ranks)} results for {n} nodes"
        check(ranks, n)
        return seconds, last_call
    finally:
        for worker in workers:
            worker.close()
        server.close()


def bench_scale_out(impl: str, procs: int) -> tuple[float, float, str]:
    """(seconds until a member sees the late node, seconds for the new round, a note)."""
    server = Server(impl)
    setup = {"options": {"last_call_timeout": 1.0}, "timeouts": {"last_call": 1.0}}
    members = start_workers(impl, server.port, split(8, procs), run_id="scale", min=8, max=9,
                            **setup)
    late = start_workers(impl, server.port, [1], run_id="scale", min=8, max=9, **setup)[0]
    try:
        check(next_round(members)[1], 8)
        members[0].send(op="watch")
        time.sleep(0.2)
        t0 = time.monotonic()
        late.send(op="next", at=t0)
        seen = members[0].read()["seen"] - t0
        seconds, ranks, _ = next_round(members, lead=0.0)
        check(ranks, 9)  # the members: ranks 0..7 of 9 (the late node has the last one)
        if not select.select([late.process.stdout], [], [], 30.0)[0]:
            return seen, seconds, "the late node did not return within 30 s"
        late_result = late.read()
        if late_result["errors"]:
            return seen, seconds, f"the late node failed: {late_result['errors'][0][:80]}"
        return seen, seconds, ""
    finally:
        for worker in members + [late]:
            worker.close()
        server.close()


def bench_failure(impl: str) -> float:
    server = Server(impl)
    survivors = start_workers(impl, server.port, [7], run_id="fail", min=2, max=8)[0]
    victim = start_workers(impl, server.port, [1], run_id="fail", min=2, max=8)[0]
    try:
        check(next_round([survivors, victim])[1], 8)
        if impl == "rdzv":
            survivors.send(op="watch")
            time.sleep(0.2)
        t0 = time.monotonic()
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(timeout=30)
        if impl == "rdzv":
            survivors.read()
        survivors.send(op="next", at=time.monotonic())
        result = survivors.read()
        if result["errors"]:
            raise RuntimeError(result["errors"][0])
        check(result["ranks"], 7)
        return result["end"] - t0
    finally:
        survivors.close()
        victim.close()
        server.close()


def fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The run of median time (with its own 'last call')."""
    return sorted(runs)[len(runs) // 2]


def ratio(torch_s: float | None, rdzv_s: float) -> str:
    return "-" if torch_s is None else f"{torch_s / rdzv_s:.0f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2,8,32,128,1000,10000")
    parser.add_argument("--procs", type=int, default=8, help="worker processes per scenario")
    parser.add_argument("--repeat", type=int, default=5,
                        help="barrier rounds per size and implementation, taken in turns (median shown)")
    parser.add_argument("--no-torch", action="store_true", help="rdzv only")
    args = parse_args(parser, worker_setup)
    with_torch = not args.no_torch
    if with_torch and importlib.util.find_spec("torch") is None:
        print("torch is not installed: rdzv only (pip install torch==2.13.0 for the comparison)")
        with_torch = False

    print(f"barrier: N nodes call next_rendezvous together (min = max = N) over {args.procs} "
          f"processes; median of {args.repeat} rounds (rdzv's slowest in brackets); 'last call': "
          f"when the last node had called (simulation lag, included)")
    print(f"{'N':>6} | {'rdzv':>10} | {'(slowest)':>10} | {'last call':>9} | {'nodes':>9} | "
          f"{'torch c10d':>10} | {'last call':>9} | ratio")
    for size, n in enumerate(int(s) for s in args.sizes.split(",")):
        kind = node_kind(n, args.nodes)
        mine: list[tuple[float, float]] = []
        theirs: list[tuple[float, float]] = []
        try:
            for repeat in range(args.repeat):
                run = size * args.repeat + repeat
                mine.append(bench_barrier("rdzv", n, args.procs, run, kind))
                if with_torch and n <= 128:
                    theirs.append(bench_barrier("torch", n, args.procs, run, "threads"))
        except (RuntimeError, AssertionError, OSError) as exc:
            print(f"{n:>6} | failed: {str(exc)[:100]}", flush=True)
            continue
        rdzv_s, lag = median(mine)
        torch_s, their_lag = median(theirs) if theirs else (None, None)
        note = "" if theirs or not with_torch else " (torch skipped: > 128)"
        print(f"{n:>6} | {fmt(rdzv_s):>10} | {'(' + fmt(max(mine)[0]) + ')':>10} | {fmt(lag):>9} | "
              f"{kind:>9} | {fmt(torch_s):>10} | {fmt(their_lag):>9} | {ratio(torch_s, rdzv_s)}"
              f"{note}", flush=True)
    note = gevent_note(args.nodes)
    if note:
        print(note)

    print("\nscale-out: 8 members, a late node arrives (max_nodes 9)")
    seen, new_round, note = bench_scale_out("rdzv", args.procs)
    t_seen, t_round, t_note = bench_scale_out("torch", args.procs) if with_torch else (None, None, "")
    print(f"{'':>14} | {'rdzv':>10} | {'torch c10d':>10} | ratio")
    print(f"{'late node seen':>14} | {fmt(seen):>10} | {fmt(t_seen):>10} | {ratio(t_seen, seen)}")
    print(f"{'new round':>14} | {fmt(new_round):>10} | {fmt(t_round):>10} | "
          f"{ratio(t_round, new_round)}", flush=True)
    for who, text in (("rdzv", note), ("torch", t_note)):
        if text:
            print(f"  note ({who}): {text}")

    print("\nfailure: 1 of 8 members SIGKILLed, default timeouts: until the survivors' new round")
    mine = bench_failure("rdzv")
    theirs = bench_failure("torch") if with_torch else None
    print(f"{'':>14} | {'rdzv':>10} | {'torch c10d':>10} | ratio")
    print(f"{'new round':>14} | {fmt(mine):>10} | {fmt(theirs):>10} | {ratio(theirs, mine)}")


if __name__ == "__main__":
    main()
