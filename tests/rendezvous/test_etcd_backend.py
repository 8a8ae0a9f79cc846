"""What only the etcd backend has (its contract is ``test_etcd_backend_contract.py``), node
processes on a real etcd (each version found): torch's legacy URL form, the key prefix, https
with client certificates, user and password as options or from the environment, a clear error
naming an unreachable endpoint, nodes SIGSTOPped past their lease and resumed, and a 3-member etcd cluster
losing its leader in the middle of a rendezvous of several processes.
Without an etcd binary these tests skip locally and fail under ``CI=true``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from _etcd import HUNG, etcd_binary, etcd_server, fresh_prefix  # noqa: F401 (fixtures)
from _nodes import ProcessNode
from rendezvous_contract import AT_ONCE, check_round, eventually, form
from test_security import PASSWORD, auth_etcd, pki, tls_etcd  # noqa: E402,F401 (fixtures)

from rdzv.errors import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousParameterError,
    StoreAuthenticationError,
)
from rdzv.etcd import LocalEtcd, LocalEtcdCluster  # noqa: E402
from rdzv.etcd._local import free_ports  # noqa: E402
from rdzv.rendezvous import get_rendezvous_handler, parse_rendezvous_url  # noqa: E402
from rdzv.rendezvous._etcd import RendezvousEtcdStore, key_prefix  # noqa: E402
from rdzv.store import EtcdStore  # noqa: E402


@pytest.fixture
def nodes() -> Iterator[list[ProcessNode]]:
    started: list[ProcessNode] = []
    yield started
    for node in started:
        node.close()


def start_nodes(nodes: list[ProcessNode], count: int, spec: dict[str, Any]) -> list[ProcessNode]:
    new = [ProcessNode(spec) for _ in range(count)]
    nodes.extend(new)
    for node in new:
        node.wait_ready()
    return new


def test_torch_legacy_url_with_workers_and_prefix(
    etcd_server: LocalEtcd, nodes: list[ProcessNode]
) -> None:
    prefix = fresh_prefix()
    url = (f"etcd://{etcd_server.endpoint}/legacy?min_workers=2&max_workers=3&timeout=600"
           f"&last_call_timeout=0.5&etcd_prefix={prefix}")
    params = parse_rendezvous_url(url)
    assert (params.min_nodes, params.max_nodes) == (2, 3)
    spec = {"backend": "etcd", "endpoint": params.endpoint, "run_id": params.run_id,
            "min_nodes": 2, "max_nodes": 3, "local_addr": "127.0.0.1", **params.config}
    check_round(form(start_nodes(nodes, 2, spec)), 2)
    with EtcdStore(etcd_server.endpoint, prefix=prefix + "/") as store:
        assert store.list_keys("rdzv/legacy/sealed"), "the run lives under etcd_prefix"
    with EtcdStore(etcd_server.endpoint, prefix="/rdzv/") as default:
        assert not default.list_keys("rdzv/legacy/"), "nothing under the default prefix"


def test_unreachable_endpoint_is_a_connection_error_naming_it() -> None:
    (port,) = free_ports(1)
    url = f"etcd://127.0.0.1:{port}/job?nnodes=2&read_timeout=1"
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        get_rendezvous_handler(url)
    assert time.monotonic() - started < AT_ONCE


def test_bad_settings_are_parameter_errors() -> None:
    with pytest.raises(RendezvousParameterError, match="ca_cert"):
        get_rendezvous_handler("etcd://127.0.0.1:2379/job?nnodes=2&protocol=https"
                               "&ca_cert=/no/such/ca.pem")
    with pytest.raises(RendezvousParameterError, match="protocol"):
        get_rendezvous_handler("etcd://127.0.0.1:2379/job?nnodes=2&protocol=gopher")


def test_https_with_client_certificates(
    tls_etcd: LocalEtcd, pki: dict[str, str], nodes: list[ProcessNode]  # noqa: F811
) -> None:
    spec = {"backend": "etcd", "endpoint": tls_etcd.endpoint, "run_id": "tls", "min_nodes": 2,
            "max_nodes": 2, "local_addr": "127.0.0.1", "protocol": "https",
            "cacert": pki["ca.pem"], "cert": pki["client.pem"], "key": pki["client.key"],
            "etcd_prefix": fresh_prefix()}
    check_round(form(start_nodes(nodes, 2, spec)), 2)


def test_user_and_password_as_options_or_from_the_environment(
    auth_etcd: LocalEtcd, nodes: list[ProcessNode], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Three nodes, three ways to give the credentials: a password file, the password in the
    URL, and the environment variables alone."""
    password_file = tmp_path / "etcd-password"
    password_file.write_text(PASSWORD + "\n")
    base = f"etcd://{auth_etcd.endpoint}/auth?nnodes=3&etcd_prefix=job/runs&local_addr=127.0.0.1"
    urls = [f"{base}&user=job&password_file={password_file}",
            f"{base}&user=job&password={PASSWORD}", base]
    specs = []
    for url in urls:
        params = parse_rendezvous_url(url)
        specs.append({"backend": "etcd", "endpoint": params.endpoint, "run_id": params.run_id,
                      "min_nodes": 3, "max_nodes": 3, "local_addr": params.local_addr,
                      **params.config})
    monkeypatch.delenv("RDZV_ETCD_USER", raising=False)
    monkeypatch.delenv("RDZV_ETCD_PASSWORD", raising=False)
    members = start_nodes(nodes, 1, specs[0]) + start_nodes(nodes, 1, specs[1])
    monkeypatch.setenv("RDZV_ETCD_USER", "job")
    monkeypatch.setenv("RDZV_ETCD_PASSWORD", PASSWORD)
    members += start_nodes(nodes, 1, specs[2])  # the environment alone
    check_round(form(members), 3)


def test_wrong_or_missing_credentials_say_how_to_give_them(
    auth_etcd: LocalEtcd, monkeypatch: pytest.MonkeyPatch, tmp_path: Path  # noqa: F811
) -> None:
    monkeypatch.delenv("RDZV_ETCD_USER", raising=False)
    monkeypatch.delenv("RDZV_ETCD_PASSWORD", raising=False)
    base = f"etcd://{auth_etcd.endpoint}/auth?nnodes=2&read_timeout=5"
    url = f"{base}&etcd_prefix=job/runs"
    with pytest.raises(StoreAuthenticationError, match="as etcd user 'job'.*password_file"):
        get_rendezvous_handler(f"{url}&user=job&password=wrong")
    with pytest.raises(StoreAuthenticationError, match="without a user.*RDZV_ETCD_USER"):
        get_rendezvous_handler(url)
    with pytest.raises(StoreAuthenticationError, match="permission denied"):
        get_rendezvous_handler(f"{base}&user=job&password={PASSWORD}&etcd_prefix=other")
    with pytest.raises(RendezvousParameterError, match="without a password.*password_file"):
        get_rendezvous_handler(f"{url}&user=job")
    monkeypatch.setenv("RDZV_ETCD_PASSWORD", PASSWORD)
    with pytest.raises(RendezvousParameterError, match="no user.*user=NAME.*RDZV_ETCD_USER"):
        get_rendezvous_handler(url)
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(RendezvousParameterError, match=f"password_file '{missing}'"):
        get_rendezvous_handler(f"{url}&user=job&password_file={missing}")
    with pytest.raises(RendezvousParameterError, match="is empty"):
        get_rendezvous_handler(f"{url}&user=job&password_file={empty}")
    with pytest.raises(RendezvousParameterError, match="both given"):
        get_rendezvous_handler(f"{url}&user=job&password=x&password_file={empty}")


# -- a node whose lease expired (stopped longer than the ttl) comes back -------------------------

def test_member_whose_lease_expired_rejoins_as_a_new_node(
    etcd_server: LocalEtcd, nodes: list[ProcessNode]
) -> None:
    """SIGSTOP a member past its 4 s lease: the others form a round without it; SIGCONT it and
    its next next_rendezvous() joins again as a new node (no error), and the others let it in."""
    spec = {"backend": "etcd", "endpoint": etcd_server.endpoint, "run_id": "lapse",
            "min_nodes": 2, "max_nodes": 3, "local_addr": "127.0.0.1", "join_timeout": 60.0,
            "last_call_timeout": 60.0, "etcd_prefix": fresh_prefix(), **HUNG}
    members = start_nodes(nodes, 3, spec)
    first = form(members)
    check_round(first, 3)
    members[2].stop()
    try:
        assert members[0].call("wait_change", AT_ONCE) is True, "its lease expired"
        second = form(members[:2])
        check_round(second, 2)
    finally:
        members[2].resume()
    revived = members[2].request("next")
    assert members[0].call("wait_change", AT_ONCE) is True, "it waits for the next round"
    third = form(members[:2]) + [revived.result(AT_ONCE)]
    check_round(third, 3)
    assert [r["rank"] for r in third[:2]] == [r["rank"] for r in second], "survivors keep ranks"
    assert third[2]["rank"] == 2, "the revived node comes in as a new node"


def test_joiner_whose_lease_expired_while_waiting_joins_again(
    etcd_server: LocalEtcd, nodes: list[ProcessNode]
) -> None:
    """A node waiting alone in a round is SIGSTOPped past its lease (its descriptor vanishes):
    after SIGCONT it notices at once and joins the same round again, so the round forms when
    the second node comes (rather than both waiting for join_timeout)."""
    spec = {"backend": "etcd", "endpoint": etcd_server.endpoint, "run_id": "lapse-joiner",
            "min_nodes": 2, "max_nodes": 2, "local_addr": "127.0.0.1", "join_timeout": 60.0,
            "etcd_prefix": fresh_prefix(), **HUNG}
    other, stopped = start_nodes(nodes, 2, spec)
    pending = stopped.request("next")
    eventually(lambda: other.call("waiting") == 1, AT_ONCE, "it waits in round 0")
    stopped.stop()
    try:
        eventually(lambda: other.call("waiting") == 0, AT_ONCE, "its lease expired")
    finally:
        stopped.resume()
    eventually(lambda: other.call("waiting") == 1, AT_ONCE, "it joined round 0 again")
    check_round([other.call("next", timeout=AT_ONCE), pending.result(AT_ONCE)], 2)


def test_sealer_that_lost_its_lock_writes_nothing(etcd_server: LocalEtcd) -> None:
    """A sealer whose lease expired (here: revoked on etcd) between taking the lock and writing
    the decision: its decision and its lock release are refused, the new sealer's stand."""
    prefix = key_prefix(fresh_prefix())
    lock, status = "rdzv/job/round/0/sealer", "rdzv/job/round/0/ctl/status"
    with RendezvousEtcdStore(etcd_server.endpoint, prefix=prefix, timeout=30) as old, \
            RendezvousEtcdStore(etcd_server.endpoint, prefix=prefix, timeout=30) as new:
        assert old.compare_set(lock, b"", b"old", ephemeral=True) == b"old"
        new.client.call("lease/revoke", {"ID": old.session.id()})
        assert new.compare_set(lock, b"", b"new", ephemeral=True) == b"new"
        assert old.multi_set_if(  # the engine's fenced write of its decision
            {lock: b"old", status: None}, ["rdzv/job/round/0/rank/0", status, lock],
            [b"old-rank", b"old-decision", b""]) is False
        old.set(lock, b"", ephemeral=True)  # the old sealer's release
        assert new.try_get(lock) == b"new", "the lock is still the new sealer's"
        assert new.try_get(status) is None and new.try_get("rdzv/job/round/0/rank/0") is None
        new.multi_set([status], [b"decision"])
        new.set(lock, b"", ephemeral=True)
        assert (new.try_get(lock), new.try_get(status)) == (b"", b"decision")


# -- a 3-member etcd cluster loses members during rendezvous ----------------------------------

@pytest.fixture
def etcd_cluster(etcd_binary: str) -> Iterator[LocalEtcdCluster]:
    with LocalEtcdCluster(3, binary=etcd_binary) as cluster:
        yield cluster


def leader_first(cluster: LocalEtcdCluster) -> tuple[int, str]:
    """The leader's index and every endpoint, the leader's first (nodes start on it)."""
    leader = cluster.leader()
    endpoints = cluster.endpoints
    ordered = [endpoints[leader]] + [e for i, e in enumerate(endpoints) if i != leader]
    return leader, ",".join(ordered)


def test_leader_killed_mid_rendezvous_and_restarted(
    etcd_cluster: LocalEtcdCluster, nodes: list[ProcessNode]
) -> None:
    leader, endpoint = leader_first(etcd_cluster)
    spec = {"backend": "etcd", "endpoint": endpoint, "run_id": "failover", "min_nodes": 5,
            "max_nodes": 5, "local_addr": "127.0.0.1", "join_timeout": 120.0,
            "read_timeout": 60.0, "etcd_prefix": fresh_prefix()}
    members = start_nodes(nodes, 5, spec)
    pending = [node.request("next") for node in members[:3]]
    eventually(lambda: members[0].call("waiting") == 3, AT_ONCE, "three nodes joined")
    etcd_cluster.kill(leader)  # SIGKILL in the middle of the round
    pending += [node.request("next") for node in members[3:]]
    first = [p.result(120.0) for p in pending]
    check_round(first, 5)

    members[0].call("store_set", "written-after-failover", "kept")
    etcd_cluster.restart(leader)  # rejoins the cluster with its data dir and catches up
    new_leader = etcd_cluster.leader()
    assert all(etcd_cluster.healthy(i) for i in range(3))
    etcd_cluster.stop(new_leader)  # the restarted member must now carry its share
    assert all(m.call("store_get", "written-after-failover") == "kept" for m in members)
    second = form(members, timeout=120.0)
    check_round(second, 5)
    assert [r["rank"] for r in second] == [r["rank"] for r in first], "members keep their ranks"
    etcd_cluster.restart(new_leader)
    with EtcdStore(etcd_cluster.endpoints[leader], prefix=key_prefix(spec["etcd_prefix"])) as s:
        assert s.get("rdzv/failover/sealed") == b"1", "the restarted member has every round"


def test_member_paused_mid_rendezvous(
    etcd_cluster: LocalEtcdCluster, nodes: list[ProcessNode]
) -> None:
    leader, endpoint = leader_first(etcd_cluster)
    spec = {"backend": "etcd", "endpoint": endpoint, "run_id": "paused", "min_nodes": 4,
            "max_nodes": 4, "local_addr": "127.0.0.1", "join_timeout": 120.0,
            "read_timeout": 60.0, "etcd_prefix": fresh_prefix()}
    members = start_nodes(nodes, 4, spec)
    pending = [node.request("next") for node in members[:2]]
    eventually(lambda: members[0].call("waiting") == 2, AT_ONCE, "two nodes joined")
    etcd_cluster.pause(leader)  # SIGSTOP: connected but silent
    try:
        pending += [node.request("next") for node in members[2:]]
        check_round([p.result(120.0) for p in pending], 4)
    finally:
        etcd_cluster.resume(leader)
    check_round(form(members, timeout=120.0), 4)  # and again with every member back
