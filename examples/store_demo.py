"""A first look at rdzv without any external service: an embedded store server and four processes.

Run it with ``python examples/store_demo.py``. The parent starts rdzv's store server on a free
loopback port; four worker processes connect to it, take distinct ranks with an atomic ``add``,
publish a value each, meet at a barrier (a blocking ``get`` woken by the last arrival), and read
each other's values.
"""

from __future__ import annotations

import subprocess
import sys
import time

import rdzv

WORKERS = 4


def worker(port: int) -> None:
    store = rdzv.TCPStore("127.0.0.1", port, timeout=30)
    rank = store.add("demo/next_rank", 1) - 1
    store.set(f"demo/hello/{rank}", f"hello from rank {rank}")
    if store.add("demo/arrived", 1) == WORKERS:
        store.set("demo/barrier", "open")
    store.get("demo/barrier")  # blocks until the last worker opens the barrier
    greetings = store.multi_get([f"demo/hello/{r}" for r in range(WORKERS)])
    print(f"rank {rank}: saw {[g.decode() for g in greetings]}", flush=True)
    store.close()


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
        return 0
    with rdzv.StoreServer(host="127.0.0.1", port=0) as server:
        print(f"store server listening on 127.0.0.1:{server.port}")
        started = time.perf_counter()
        procs = [
            subprocess.Popen([sys.executable, __file__, "--worker", str(server.port)])
            for _ in range(WORKERS)
        ]
        codes = [p.wait(timeout=60) for p in procs]
        print(f"{WORKERS} workers done in {time.perf_counter() - started:.2f} s, exit codes {codes}")
        return max(codes)


if __name__ == "__main__":
    sys.exit(main())
