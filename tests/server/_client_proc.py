"""Client processes for server tests: ``python _client_proc.py MODE PORT [ARGS...]``.

Modes (each prints what it did, one line at a time, flushed):

* ``ephemeral PORT TTL KEY``: sets KEY ephemerally (flushed), prints ``ready <session id>``, then
  holds its session until it is killed or its input closes (its test ended).
* ``writer PORT COUNT``: sets ``w/<i>`` for i in 0..COUNT-1 (pipelined), and after every 10th
  prints ``ack <i> <time.monotonic()>`` once ``flush()`` confirmed every set up to it; then
  ``done``; carries on across a server restart.
* ``waiters PORT N KEY``: opens N clients, each blocked in ``get(KEY)`` in its own thread after
  ``add("ready", 1)``; prints ``connected`` once all are open, then, when all are woken, a JSON
  line ``{"woken": N, "last": <time.time() of the last wake-up>}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from rdzv.store import TCPStore


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def ephemeral(port: int, ttl: float, key: str) -> None:
    store = TCPStore("127.0.0.1", port, timeout=30, session_ttl=ttl)
    store.set(key, "alive", ephemeral=True)
    store.flush()
    say(f"ready {store.session_id}")
    sys.stdin.read()


def writer(port: int, count: int) -> None:
    store = TCPStore("127.0.0.1", port, timeout=60, session_ttl=5)
    for i in range(count):
        store.set(f"w/{i}", str(i))
        if i % 10 == 9 or i == count - 1:
            store.flush()
            say(f"ack {i} {time.monotonic()!r}")  # (the clock that the test reads too)
    say("done")
    store.close()


def waiters(port: int, n: int, key: str) -> None:
    stores = [TCPStore("127.0.0.1", port, timeout=120, session_ttl=30) for _ in range(n)]
    say("connected")
    woken: list[float] = []
    lock = threading.Lock()

    def wait(store: TCPStore) -> None:
        store.add("ready", 1)
        store.get(key)
        now = time.time()
        with lock:
            woken.append(now)

    threads = [threading.Thread(target=wait, args=(s,), daemon=True) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    say(json.dumps({"woken": len(woken), "last": max(woken)}))
    for store in stores:
        store.close()


if __name__ == "__main__":
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "ephemeral":
        ephemeral(port, float(sys.argv[3]), sys.argv[4])
    elif mode == "writer":
        writer(port, int(sys.argv[3]))
    elif mode == "waiters":
        waiters(port, int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode}")
