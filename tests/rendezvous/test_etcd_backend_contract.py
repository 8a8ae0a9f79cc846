"""The rendezvous contract on the etcd backend: node processes on a real etcd (each version
found). Without an etcd binary these tests skip locally and fail under ``CI=true``."""

from __future__ import annotations

from typing import Iterator

import pytest

from _etcd import EtcdCluster, etcd_binary, etcd_server  # noqa: F401 (fixtures)
from rendezvous_contract import AT_ONCE, RendezvousContract, check_round, eventually

from rdzv.etcd import LocalEtcd


class TestEtcdBackend(RendezvousContract):
    @pytest.fixture
    def cluster(self, etcd_server: LocalEtcd) -> Iterator[EtcdCluster]:
        cluster = EtcdCluster(etcd_server.endpoint)
        yield cluster
        cluster.close()

    def test_round_completes_without_a_node_that_died_in_the_last_call(self, cluster):
        """etcd has no connection-bound session: a killed node is dropped when its lease
        expires, so the last call here outlasts the 6 s lease (the contract's 2 s would not)."""
        nodes = [cluster.node(2, 4, last_call_timeout=12.0) for _ in range(3)]
        pending = [n.request("next") for n in nodes]
        eventually(lambda: nodes[0].call("waiting") == 3, AT_ONCE, "three joined")
        nodes[2].kill()
        eventually(lambda: nodes[0].call("waiting") == 2, AT_ONCE, "the dead node is dropped")
        check_round([p.result(AT_ONCE) for p in pending[:2]], 2)
