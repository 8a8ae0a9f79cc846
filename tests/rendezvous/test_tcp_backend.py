"""The rendezvous contract on the tcp backend: node processes on a store server on loopback.

Also what only the tcp backend has: the node at the endpoint hosts the server, and a store server
killed mid-round gives the waiting nodes a clear RendezvousConnectionError, not a hang.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from _clusters import ProcessCluster
from _nodes import NodeError, ProcessNode
from _waiting import eventually
from rendezvous_contract import AT_ONCE, RendezvousContract, check_round, form

from rdzv.rendezvous import get_rendezvous_handler
from rdzv.rendezvous._layout import RunKeys
from rdzv.server import StoreServer
from rdzv.kv import protocol as P
from rdzv.store._tcp import TCPStore

ANSWER_WAITERS = (
    "[print(len(s._core.waiters.get(path.strip(), ())), flush=True) for path in sys.stdin]"
)
"""The end of a server script: for each path read on stdin, the number of requests waiting on
it is printed (see :func:`waiting_on`), until stdin closes."""
SERVER_SCRIPT = (
    "import sys; from rdzv.server import StoreServer; s = StoreServer('127.0.0.1', 0).start(); "
    "print(s.port, flush=True); " + ANSWER_WAITERS
)
ROUND_0_CTL = RunKeys("job").ctl(0)
"""What a node waiting in round 0 of run ``job`` watches."""


def waiting_on(server: subprocess.Popen, path: str) -> int:
    """The requests waiting on ``path`` in the store server process ``server``."""
    server.stdin.write(path + "\n")
    server.stdin.flush()
    return int(server.stdout.readline())


@pytest.fixture
def server():
    with StoreServer("127.0.0.1", 0) as running:
        yield running


class TestTcpBackend(RendezvousContract):
    @pytest.fixture
    def cluster(self, server):
        endpoint = f"127.0.0.1:{server.port}"
        cluster = ProcessCluster(
            "tcp", endpoint,
            raw_store=lambda: TCPStore("127.0.0.1", server.port, timeout=30),
            hung_options={"heartbeat_interval": 0.3, "heartbeat_misses": 3},
            is_host=False, read_timeout=5.0,
        )
        yield cluster
        cluster.close()


def test_node_at_the_endpoint_hosts_the_server(unused_port):
    spec = {"backend": "tcp", "endpoint": f"127.0.0.1:{unused_port}", "run_id": "job",
            "min_nodes": 2, "max_nodes": 2, "local_addr": "127.0.0.1", "join_timeout": 60.0}
    host = ProcessNode(spec)
    other = ProcessNode({**spec, "is_host": False})
    try:
        check_round(form([host, other]), 2)
    finally:
        other.close()
        host.close()


@pytest.fixture
def unused_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_store_server_killed_mid_round_raises_connection_error():
    server = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    node = None
    try:
        port = int(server.stdout.readline())
        node = ProcessNode({"backend": "tcp", "endpoint": f"127.0.0.1:{port}", "run_id": "job",
                            "min_nodes": 2, "max_nodes": 2, "local_addr": "127.0.0.1",
                            "is_host": False, "read_timeout": 2.0, "join_timeout": 600.0})
        pending = node.request("next")
        eventually(lambda: waiting_on(server, ROUND_0_CTL) == 1, AT_ONCE,
                   "the node to wait in round 0 on the server")
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        started = time.monotonic()
        with pytest.raises(NodeError) as info:
            pending.result(AT_ONCE)
        assert info.value.type_name == "StoreConnectionError"  # a RendezvousConnectionError
        assert f"127.0.0.1:{port}" in str(info.value)
        assert time.monotonic() - started < AT_ONCE
    finally:
        if node is not None:
            node.close()
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


def test_shutdown_with_the_store_server_gone_gives_up_after_close_timeout():
    server = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        handler = get_rendezvous_handler(
            f"tcp://127.0.0.1:{port}/job?min_nodes=1&max_nodes=1&is_host=false"
            "&read_timeout=300&close_timeout=1&local_addr=127.0.0.1"
        )
        assert handler.next_rendezvous().world_size == 1
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        handler.record_event("workers_started", nproc=1)  # a history write on its way, too
        started = time.monotonic()
        assert handler.shutdown() is False  # leaving could not reach the store, and says so
        # bounded by close_timeout, not read_timeout (300 s), for the history's client too
        assert time.monotonic() - started < 20
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


DURABLE_SERVER_SCRIPT = (
    "import sys; from rdzv.server import StoreServer; "
    "s = StoreServer('127.0.0.1', int(sys.argv[1]), data_dir=sys.argv[2]).start(); "
    "print(s.port, flush=True); " + ANSWER_WAITERS
)


def test_a_call_retried_after_losing_the_store_joins_with_its_keys_kept(tmp_path, unused_port):
    """A durable store server is killed while a node waits: its next_rendezvous() raises. Once
    the server is back (keys and sessions restored from its data dir) the node calls again: it
    joins the same round under the same keys and must not delete them as leftovers of the failed
    call, so a second node completes the round with it."""

    def start_server() -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", DURABLE_SERVER_SCRIPT, str(unused_port), str(tmp_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert int(process.stdout.readline()) == unused_port
        return process

    spec = {"backend": "tcp", "endpoint": f"127.0.0.1:{unused_port}", "run_id": "job",
            "min_nodes": 2, "max_nodes": 2, "local_addr": "127.0.0.1", "is_host": False,
            "read_timeout": 2.0, "join_timeout": 20.0,
            "heartbeat_interval": 10.0, "heartbeat_misses": 6}  # the session outlives the outage
    server = start_server()
    nodes: list[ProcessNode] = []
    try:
        nodes.append(ProcessNode(spec))
        pending = nodes[0].request("next")
        eventually(lambda: waiting_on(server, ROUND_0_CTL) == 1, AT_ONCE,
                   "the node to wait in round 0 on the server")
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        with pytest.raises(NodeError) as info:
            pending.result(AT_ONCE)
        assert info.value.type_name == "StoreConnectionError"
        server = start_server()
        retried = nodes[0].request("next")
        # waiting again (having deleted what it no longer needs) on the restarted server
        eventually(lambda: waiting_on(server, ROUND_0_CTL) == 1, AT_ONCE,
                   "the retried call to wait in round 0 on the restarted server")
        nodes.append(ProcessNode(spec))
        second = nodes[1].request("next")
        check_round([retried.result(AT_ONCE), second.result(AT_ONCE)], 2)
    finally:
        for node in nodes:
            node.close()
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


def test_a_store_server_without_conditional_writes_still_forms_rounds(server):
    """A store server of an rdzv version before fencing answers MULTI_SET_IF "unknown opcode":
    the sealer falls back to the unfenced write of its decision (with a warning), checks it
    against the status it reads back, and the round forms as before."""
    from rdzv.server._dispatch import unknown_op

    core = server._core
    core.handlers[P.OP_MULTI_SET_IF] = unknown_op  # as the previous version's table
    cluster = ProcessCluster("tcp", f"127.0.0.1:{server.port}", raw_store=lambda: TCPStore(
        "127.0.0.1", server.port, timeout=30), hung_options=None, is_host=False)
    try:
        nodes = [cluster.node(3, 3) for _ in range(3)]
        check_round(form(nodes), 3)
        store = cluster.raw_store()
        assert store.try_get("rdzv/job/round/0/sealer") == b""  # released
        assert all(n.call("wait_change", 0.2) is False for n in nodes)
    finally:
        cluster.close()


def test_a_membership_poll_without_a_change_is_one_watch_request(server):
    """An agent polls its round's membership every monitor interval for as long as its workers
    train: while nothing changes each poll costs the server one watch, not a read of the round
    (1,000 nodes polling every 0.1 s would otherwise ask some 80,000 requests a second)."""
    cluster = ProcessCluster("tcp", f"127.0.0.1:{server.port}", raw_store=lambda: TCPStore(
        "127.0.0.1", server.port, timeout=30), hung_options=None, is_host=False)
    try:
        a, b = cluster.node(2, 2), cluster.node(2, 2)
        form([a, b])
        seen = a.call("membership")
        before = server.metrics().requests
        for _ in range(5):
            assert a.call("membership", seen[4], 0.1) == seen
        after = server.metrics().requests
        grew = {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}
        # the node's history, released by the first call, may write its batch meanwhile: a
        # multi_set then one count_keys, the first of which may land before the snapshot (a
        # read of the round would be 3 counts and its gets)
        history = grew.pop("multi_set", 0)
        assert grew.pop("count_keys", 0) <= history + 1 and grew == {"watch": 5}, (history, grew)
    finally:
        cluster.close()
