"""The static backend: fixed ranks, a barrier on the store, rank 0 hosting the TCPStore.

In-process tests share a HashStore between handler threads (the ``store=`` argument); the
process tests run 3 real nodes on loopback, rank 0 hosting the store server.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from _waiting import eventually

import rdzv.store
from rdzv.rendezvous import (
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    get_rendezvous_handler,
)
from rdzv.rendezvous._static import StaticRendezvousHandler, create_handler
from rdzv.store import HashStore


def waiting_in(shared: HashStore) -> int:
    """The threads blocked in a wait on ``shared`` (its clients' barrier), as its condition holds
    them (CPython's ``Condition._waiters``: one lock per thread inside ``wait()``)."""
    cond = shared._shared.cond
    with cond:
        return len(cond._waiters)  # type: ignore[attr-defined]


def node(store: HashStore, rank: int, world_size: int = 3, timeout: float = 60.0) -> StaticRendezvousHandler:
    return StaticRendezvousHandler("10.0.0.1", 29400, rank, world_size, "job", timeout, store=store.client())


# -- creating handlers -------------------------------------------------------------------------

def test_rank_and_world_size_from_options() -> None:
    handler = create_handler(RendezvousParameters("static", "10.0.0.1:29400", "job", 3, 3, rank="2", timeout=5))
    assert (handler.rank, handler.world_size, handler.timeout) == (2, 3, 5.0)
    assert (handler.master_addr, handler.master_port) == ("10.0.0.1", 29400)


def test_rank_and_world_size_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    handler = get_rendezvous_handler("static://[::1]:29400/job")
    assert (handler.rank, handler.world_size, handler.master_addr) == (1, 2, "::1")


def test_missing_rank_says_how_to_give_it(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"needs this node's rank: give the option rank=N .* or set "
                       r"the environment variable RANK"):
        create_handler(RendezvousParameters("static", "h:1", "job", 2, 2))


@pytest.mark.parametrize(
    "endpoint, min_nodes, max_nodes, options, message",
    [
        ("h:1", 2, 2, {"rank": 2}, "rank must be in 0..1 (world_size=2), got rank=2"),
        ("h:1", 1, 2, {"rank": 0}, "min_nodes (1), max_nodes (2) and world_size (2) must be equal"),
        ("h:1", 2, 2, {"rank": 0, "world_size": 3}, "and world_size (3) must be equal"),
        ("h", 1, 1, {"rank": 0}, "must be the master's HOST:PORT, e.g. '10.0.0.1:29400', got 'h'"),
        ("h:0", 1, 1, {"rank": 0}, "got 'h:0'"),
    ],
)
def test_invalid_static_setups_are_named(endpoint, min_nodes, max_nodes, options, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        create_handler(RendezvousParameters("static", endpoint, "job", min_nodes, max_nodes, **options))


def test_bad_rank_in_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "first")
    with pytest.raises(ValueError, match="The environment variable RANK must be an integer >= 0, got 'first'"):
        create_handler(RendezvousParameters("static", "h:1", "job", 1, 1))


# -- in one process, over a shared HashStore -------------------------------------------------------

def test_barrier_waits_for_every_rank_and_hands_out_a_shared_store() -> None:
    shared = HashStore()
    handlers = [node(shared, rank) for rank in range(3)]
    with ThreadPoolExecutor(3) as pool:
        early = [pool.submit(h.next_rendezvous) for h in handlers[:2]]
        eventually(lambda: waiting_in(shared) == 2, 60, "ranks 0 and 1 waiting in the barrier")
        assert not any(f.done() for f in early), "the barrier opened before rank 2 arrived"
        last = pool.submit(handlers[2].next_rendezvous)
        infos = [f.result(timeout=60) for f in (*early, last)]
    assert [(i.rank, i.world_size) for i in infos] == [(0, 3), (1, 3), (2, 3)]
    assert all(i.bootstrap_store_info == RendezvousStoreInfo("10.0.0.1", 29400) for i in infos)
    infos[0].store.set("greeting", "hi")
    assert infos[2].store.get("greeting") == b"hi"
    assert shared.try_get("job/greeting") == b"hi"  # the round's store is scoped to the run id
    assert all(h.use_agent_store and h.num_nodes_waiting() == 0 for h in handlers)


def test_a_second_call_returns_the_same_round_at_once() -> None:
    shared = HashStore()
    handler = node(shared, 0, world_size=1)
    first = handler.next_rendezvous()
    assert handler.next_rendezvous() is first
    assert isinstance(first, RendezvousInfo)


def test_timeout_names_the_missing_ranks() -> None:
    shared = HashStore()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(node(shared, rank, timeout=0.5).next_rendezvous) for rank in (0, 2)]
        for future in futures:
            with pytest.raises(RendezvousTimeoutError, match=r"rank\(s\) \[1\] of world_size 3 did "
                               r"not arrive within 0\.5 s at 10\.0\.0\.1:29400"):
                future.result(timeout=60)


def test_closing_is_seen_by_every_node() -> None:
    shared = HashStore()
    handlers = [node(shared, rank, world_size=2) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: h.next_rendezvous(), handlers))
    assert not handlers[1].is_closed()
    handlers[0].set_closed()
    assert handlers[1].is_closed()
    with pytest.raises(RendezvousClosedError, match="the static rendezvous 'job' is closed"):
        handlers[1].next_rendezvous()


def test_membership_never_changes() -> None:
    handler = node(HashStore(), 0, world_size=1)
    assert handler.wait_for_membership_change(0.05) is False
    closer = threading.Timer(0.1, handler.shutdown)
    closer.start()
    assert handler.wait_for_membership_change(60) is False  # returns once shut down
    closer.join()
    assert handler.shutdown() is True


# -- real processes over TCPStore -----------------------------------------------------------------

needs_tcp_store = pytest.mark.skipif(
    not hasattr(rdzv.store, "TCPStore"), reason="rdzv.store.TCPStore has not landed yet"
)

NODE_SCRIPT = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    from rdzv.rendezvous import RendezvousError, get_rendezvous_handler

    handler = get_rendezvous_handler(sys.argv[1])
    try:
        info = handler.next_rendezvous()
        store, rank, world_size = info
        store.set(f"hello/{rank}", str(rank))
        store.wait([f"hello/{r}" for r in range(world_size)], timedelta(seconds=60))
        store.add("sum", rank + 1)
        result = {"rank": rank, "world_size": world_size,
                  "seen": sorted(int(v) for v in store.multi_get([f"hello/{r}" for r in range(world_size)])),
                  "again": handler.next_rendezvous() is info,
                  "bootstrap": [info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port]}
        # The last use of the store: rank 0 hosts it, and stops it once everyone is done.
        store.set(f"finished/{rank}", "1")
        if rank == 0:
            store.wait([f"finished/{r}" for r in range(world_size)], timedelta(seconds=60))
    except RendezvousError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        handler.shutdown()
    print(json.dumps(result), flush=True)
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def start_node(tmp_path):
    """Start node processes (their stderr in the file ``process.log``); every one is stopped at
    teardown."""
    processes: list[subprocess.Popen] = []

    def start(url: str) -> subprocess.Popen:
        log = tmp_path / f"node-{len(processes)}.log"
        with open(log, "w") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-c", NODE_SCRIPT, url], stdout=subprocess.PIPE, stderr=stderr, text=True
            )
        process.log = log  # type: ignore[attr-defined]
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


def result_of(process: subprocess.Popen) -> dict:
    out, _ = process.communicate(timeout=90)
    assert process.returncode == 0, process.log.read_text()  # type: ignore[attr-defined]
    return json.loads(out.strip().splitlines()[-1])


@needs_tcp_store
def test_three_processes_form_the_static_group(start_node) -> None:
    port = free_port()
    url = f"static://127.0.0.1:{port}/job?world_size=3&timeout=60&rank="
    # Ranks 1 and 2 start before rank 0 hosts the store: they retry until it is up.
    others = [start_node(url + str(rank)) for rank in (2, 1)]
    eventually(lambda: all("cannot reach the store server" in p.log.read_text() for p in others),
               60, "ranks 1 and 2 to say that they retry reaching rank 0's store")
    host = start_node(url + "0")
    results = sorted((result_of(p) for p in [host, *others]), key=lambda r: r.get("rank", -1))
    assert [r.get("rank") for r in results] == [0, 1, 2], results
    for result in results:
        assert result["world_size"] == 3 and result["seen"] == [0, 1, 2] and result["again"] is True
        assert result["bootstrap"] == ["127.0.0.1", port]


@needs_tcp_store
def test_a_missing_process_times_out_naming_its_rank(start_node) -> None:
    url = f"static://127.0.0.1:{free_port()}/job?world_size=3&timeout=3&rank="
    host, other = [result_of(p) for p in [start_node(url + "0"), start_node(url + "1")]]
    assert host["error"] == "RendezvousTimeoutError"
    assert "rank(s) [2] of world_size 3 did not arrive within 3 s" in host["message"]
    # Rank 1 times out too, unless rank 0 gave up (and stopped serving the store) first.
    if other["error"] == "RendezvousConnectionError":
        assert "rank 1 lost the store hosted by rank 0" in other["message"]
    else:
        assert other["error"] == "RendezvousTimeoutError"
        assert "rank(s) [2] of world_size 3 did not arrive within 3 s" in other["message"]


@needs_tcp_store
def test_losing_rank_0_mid_barrier_is_a_connection_error(start_node) -> None:
    # rank 1's store tries to reconnect for its timeout (a durable server may come back)
    port = free_port()
    url = f"static://127.0.0.1:{port}/job?world_size=3&timeout=10&rank="
    host = start_node(url + "0")
    other = start_node(url + "1")
    probe = rdzv.store.TCPStore("127.0.0.1", port, timeout=60)  # (waits for rank 0 to host it)
    try:  # both have arrived: they wait in the barrier for rank 2
        eventually(lambda: probe.check([f"rdzv.static/job/arrived/{rank}" for rank in (0, 1)]), 60,
                   "ranks 0 and 1 in the barrier")
    finally:
        probe.close()
    host.kill()
    result = result_of(other)
    assert result["error"] == "RendezvousConnectionError", result
    assert "127.0.0.1" in result["message"]
