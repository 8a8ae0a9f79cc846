"""A 3-member etcd cluster loses a member while client processes write and wait on it.

Clients list the doomed member first, so they are connected to it when it dies or hangs; they
must carry on through the other members without losing any write they saw acknowledged.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any, Iterator

import pytest
from _waiting import eventually

from rdzv.etcd import LocalEtcdCluster
from rdzv.store import EtcdStore

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_etcd_peer.py")
WRITES = 3000
DEADLINE = 120.0


class Peer:
    """A ``_etcd_peer.py`` process whose JSON lines arrive on a queue."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, PEER, json.dumps(spec)], stdout=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.acked = -1
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(json.loads(line))

    def next(self, timeout: float = DEADLINE) -> dict[str, Any]:
        message = self.lines.get(timeout=timeout)
        assert "error" not in message, f"peer failed: {message}"
        self.acked = message.get("acked", self.acked)
        return message

    def wait_acked(self, count: int) -> None:
        while self.acked < count - 1:
            self.next()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


@pytest.fixture
def cluster(etcd_binary: str) -> Iterator[LocalEtcdCluster]:
    with LocalEtcdCluster(3, binary=etcd_binary) as cluster:
        yield cluster


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.close()


def doomed_first(cluster: LocalEtcdCluster, doomed: int) -> list[str]:
    endpoints = cluster.endpoints
    return [endpoints[doomed]] + [e for i, e in enumerate(endpoints) if i != doomed]


def run_fault(cluster: LocalEtcdCluster, peers: list[Peer], doomed: int, fault: str) -> None:
    endpoints = doomed_first(cluster, doomed)
    writers = [Peer({"endpoints": endpoints, "prefix": "f/", "op": "write", "name": f"w{i}",
                     "count": WRITES}) for i in range(2)]  # fmt: skip
    getter = Peer({"endpoints": endpoints, "prefix": "f/", "op": "get", "key": "release"})
    peers.extend(writers + [getter])
    assert getter.next() == {"ready": True}
    for writer in writers:
        writer.wait_acked(50)
    getattr(cluster, fault)(doomed)
    with EtcdStore(endpoints[1:], request_timeout=3) as store:
        store.set("f/release", "go")
        assert getter.next() == {"value": "go"}
        for writer in writers:
            writer.wait_acked(WRITES)
            assert writer.process.wait(DEADLINE) == 0
        for number in range(2):
            stored = store.list_keys(f"f/w{number}/")
            assert len(stored) == WRITES, "acknowledged writes were lost"
            assert all(stored[f"f/w{number}/{i}"] == str(i).encode() for i in range(WRITES))


def test_leader_killed_while_clients_write_and_wait(
    cluster: LocalEtcdCluster, peers: list[Peer]
) -> None:
    run_fault(cluster, peers, cluster.leader(), "kill")
    assert cluster.leader() is not None


def test_member_hung_while_clients_write_and_wait(
    cluster: LocalEtcdCluster, peers: list[Peer]
) -> None:
    leader = cluster.leader()
    follower = (leader + 1) % 3
    run_fault(cluster, peers, follower, "pause")
    cluster.resume(follower)


def test_stopped_member_restarts_and_catches_up(cluster: LocalEtcdCluster) -> None:
    with EtcdStore(cluster.endpoints, request_timeout=3) as store:
        store.set("before", "1")
        cluster.stop(2)
        store.multi_set([f"while-down/{i}" for i in range(100)], ["x"] * 100)
        cluster.restart(2)
    with EtcdStore(cluster.endpoints[2], request_timeout=3) as member:
        eventually(lambda: member.count_keys("while-down/") == 100, 30,
                   "the restarted member to hold the 100 keys written while it was down")
        assert member.get("before") == b"1"
