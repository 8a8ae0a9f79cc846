"""Store queue speed: rdzv's TCPStore queues (built on compare_set) against torch's TCPStore
queues (server operations), side by side.

Run: ``.venv/bin/python bench/store_queues.py [--ops 2000] [--depth 1000] [--rounds 3]``

Both servers run in a process of their own, as in ``bench/store.py``. One client in this process:

* alternate: ``queue_push`` then ``queue_pop`` of one 32-byte item, ``--ops`` times (the queue
  holds at most one item): operations per second.
* fill and drain: ``--depth`` pushes, then as many pops (the queue grows to ``--depth`` items:
  rdzv's push and pop carry the whole queue, so their cost grows with it): operations per second.

The implementations take turns for ``--rounds`` rounds; the best round of each is shown.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from store import CLIENTS, start_rdzv_server, start_torch_server  # noqa: E402

ITEM = b"x" * 32


def alternate(client: Any, ops: int) -> float:
    started = time.perf_counter()
    for _ in range(ops):
        client.queue_push("alt", ITEM)
        client.queue_pop("alt")
    return 2 * ops / (time.perf_counter() - started)


def fill_and_drain(client: Any, depth: int, round_number: int) -> float:
    key = f"deep{round_number}"
    started = time.perf_counter()
    for _ in range(depth):
        client.queue_push(key, ITEM)
    for _ in range(depth):
        client.queue_pop(key)
    return 2 * depth / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="push+pop pairs per alternate round")
    parser.add_argument("--depth", type=int, default=1000, help="items of the fill-and-drain queue")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per implementation")
    args = parser.parse_args()
    servers = {"rdzv": start_rdzv_server(), "torch": start_torch_server()}
    best: dict[tuple[str, str], float] = {}
    try:
        clients = {impl: CLIENTS[impl](port) for impl, (_, port) in servers.items()}
        for round_number in range(args.rounds):
            for impl, client in clients.items():
                for name, rate in (
                    ("alternate", alternate(client, args.ops)),
                    (f"fill {args.depth}, drain", fill_and_drain(client, args.depth, round_number)),
                ):
                    best[(impl, name)] = max(best.get((impl, name), 0.0), rate)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
    print("| queue ops, one client | rdzv ops/s | torch ops/s | torch / rdzv |")
    print("|---|---|---|---|")
    for name in ("alternate", f"fill {args.depth}, drain"):
        ours, theirs = best[("rdzv", name)], best[("torch", name)]
        print(f"| {name} | {ours:,.0f} | {theirs:,.0f} | {theirs / ours:.1f}x |")


if __name__ == "__main__":
    main()
