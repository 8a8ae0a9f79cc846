"""The rendezvous contract on the etcd backend: node processes on a real etcd (each version
found). Without an etcd binary these tests skip locally and fail under ``CI=true``."""

from __future__ import annotations

from typing import Iterator

import pytest

from _etcd import EtcdCluster, etcd_binary, etcd_server  # noqa: F401 (fixtures)
from rendezvous_contract import RendezvousContract

from rdzv.etcd import LocalEtcd


class TestEtcdBackend(RendezvousContract):
    DEATH_IN_LAST_CALL = 12.0
    """etcd has no connection-bound session: a killed node is dropped when its lease expires,
    so the last call outlasts the 6 s lease (the contract's 2 s would not)."""

    @pytest.fixture
    def cluster(self, etcd_server: LocalEtcd) -> Iterator[EtcdCluster]:
        cluster = EtcdCluster(etcd_server.endpoint)
        yield cluster
        cluster.close()
