"""LocalEtcd and LocalEtcdCluster start real etcd servers, inject faults and clean up after."""

from __future__ import annotations

import os

import pytest

from rdzv.etcd import EtcdNotFoundError, LocalEtcd, LocalEtcdCluster, find_etcd_binary
from rdzv.store import EtcdStore


def test_local_etcd_serves_and_cleans_up(etcd_binary: str) -> None:
    with LocalEtcd(binary=etcd_binary) as etcd:
        assert etcd.url == f"http://{etcd.endpoint}"
        assert etcd.healthy(0)
        process = etcd._members[0].process
        assert process is not None and etcd.pid(0) == process.pid
        data_dir = etcd._members[0].data_dir
        assert os.path.isdir(data_dir)
        with EtcdStore(etcd.endpoint) as store:
            store.set("k", "v")
            assert store.get("k") == b"v"
    assert process.poll() is not None
    assert not os.path.exists(data_dir)


def test_cluster_member_killed_and_restarted_keeps_data(etcd_binary: str) -> None:
    with LocalEtcdCluster(3, binary=etcd_binary) as cluster:
        assert len(set(cluster.endpoints)) == 3
        leader = cluster.leader()
        with EtcdStore(cluster.endpoints, request_timeout=3) as store:
            store.set("before", "1")
            cluster.kill(leader)
            assert not cluster.healthy(leader)
            assert cluster.leader() != leader
            store.set("during", "2")
            cluster.restart(leader)
            assert cluster.healthy(leader)
        with EtcdStore(cluster.endpoints[leader]) as rejoined:
            assert rejoined.multi_get(["before", "during"]) == [b"1", b"2"]


def test_paused_member_resumes(etcd_binary: str) -> None:
    with LocalEtcdCluster(3, binary=etcd_binary) as cluster:
        cluster.pause(1)
        assert not cluster.healthy(1)
        cluster.resume(1)
        with EtcdStore(cluster.endpoints[1], request_timeout=5) as store:
            store.set("k", "v")


def test_bad_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("RDZV_ETCD_BINARY", str(tmp_path / "missing-etcd"))
    with pytest.raises(EtcdNotFoundError, match="RDZV_ETCD_BINARY"):
        find_etcd_binary()


def test_invalid_cluster_size() -> None:
    with pytest.raises(ValueError, match="at least 1 member"):
        LocalEtcdCluster(0, binary="/bin/true")
