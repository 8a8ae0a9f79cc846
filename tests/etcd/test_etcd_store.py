"""EtcdStore behaviour beyond the Store contract: lost leases, compaction, big batches, fork."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from rdzv.errors import SessionExpiredError
from rdzv.etcd import LocalEtcd
from rdzv.store import EtcdStore
from _waiting import eventually as wait_until


@pytest.fixture(scope="module")
def etcd(etcd_binary: str) -> Iterator[LocalEtcd]:
    with LocalEtcd(binary=etcd_binary) as server:
        yield server


@pytest.fixture
def store(etcd: LocalEtcd, request: pytest.FixtureRequest) -> Iterator[EtcdStore]:
    with EtcdStore(etcd.endpoint, prefix=f"{request.node.name}/", session_ttl=2) as store:
        yield store




def test_a_fresh_cluster_answers_revision_at_once(etcd_binary: str) -> None:
    """Nothing written yet (etcd at its first revision, which no change has): its history is
    empty. It used to wait 60 s for an event at that revision, then fail."""
    with LocalEtcd(binary=etcd_binary) as fresh, EtcdStore(fresh.endpoint) as store:
        assert store.revision("never/written") == 0
        store.set("k", "1")
        assert store.revision("k") > 0 and store.revision("never/written") == 0


def test_lost_lease_is_reported_once_then_renewed(store: EtcdStore, etcd: LocalEtcd) -> None:
    store.set("mine", "1", ephemeral=True)
    with EtcdStore(etcd.endpoint) as admin:
        admin.client.call("lease/revoke", {"ID": store.session.id()})
    wait_until(lambda: store.try_get("mine") is None)
    with pytest.raises(SessionExpiredError, match="ephemeral keys were deleted|session expired"):
        store.set("again", "2", ephemeral=True)
    store.set("again", "3", ephemeral=True)
    assert store.get("again") == b"3"


def test_a_lost_lease_found_by_the_keep_alive_and_a_write_is_reported_once(
    store: EtcdStore,
) -> None:
    """The keep-alive finds the lease gone, then a write sent with it fails and raises: the
    caller has been told, so its next ephemeral write gets a new lease (no second error)."""
    lease = store.session.id()
    store.session.lost(lease, "not renewed within 2 s")  # the keep-alive thread, first
    store.session.lost(lease, "lease not found", reported=True)  # the write that raised
    store.set("renewed", "1", ephemeral=True)
    assert store.session.id() != lease and store.get("renewed") == b"1"


def test_watch_and_revision_after_compaction(store: EtcdStore) -> None:
    store.set("old/k", "1")
    since = store.revision("old/")
    store.delete_key("old/k")
    store.set("other", "x")
    current = store.revision("other")
    store.client.call("kv/compaction", {"revision": current, "physical": True})
    assert store.watch("old/", since, 5) > since  # history is gone: reported as a change
    assert store.revision("old/") >= since


def test_batches_larger_than_one_transaction(store: EtcdStore) -> None:
    keys = [f"many/{i}" for i in range(300)]
    store.multi_set(keys, [str(i) for i in range(300)])
    assert store.multi_get(keys) == [str(i).encode() for i in range(300)]
    assert store.count_keys("many/") == 300
    assert store.check(keys)


def test_store_used_in_a_forked_child(store: EtcdStore) -> None:
    store.set("before-fork", "1")
    pid = os.fork()
    if pid == 0:  # the child uses the inherited store: it must not share the parent's sockets
        code = 1
        try:
            for i in range(50):
                store.set(f"child/{i}", str(i))
            code = 0 if store.get("before-fork") == b"1" else 1
        finally:
            os._exit(code)
    for i in range(50):
        store.set(f"parent/{i}", str(i))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.count_keys("child/") == store.count_keys("parent/") == 50


def test_unknown_option_is_a_type_error(etcd: LocalEtcd) -> None:
    with pytest.raises(TypeError, match="unknown etcd option.*request_timeuot"):
        EtcdStore(etcd.endpoint, request_timeuot=3)
