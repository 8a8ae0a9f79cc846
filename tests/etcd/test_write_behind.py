"""The etcd rendezvous store holds a joiner's ephemeral keys back until its next request.

Checked against a real etcd with a second client as the observer, and with etcd's own request
counters (``/metrics``) for "sent in the same transaction".
"""

from __future__ import annotations

import re
import threading
import urllib.request
import uuid
from typing import Iterator

import pytest
from _waiting import eventually

from rdzv.errors import SessionExpiredError
from rdzv.etcd import LocalEtcd
from rdzv.rendezvous._etcd import RendezvousEtcdStore, key_prefix
from rdzv.store import EtcdStore

ROUND = "rdzv/job/round/0/"


@pytest.fixture(scope="module")
def etcd(etcd_binary: str) -> Iterator[LocalEtcd]:
    with LocalEtcd(binary=etcd_binary) as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return key_prefix(f"/wb-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def joiner(etcd: LocalEtcd, prefix: str) -> Iterator[RendezvousEtcdStore]:
    with RendezvousEtcdStore(etcd.endpoint, prefix=prefix, session_ttl=10, timeout=30) as store:
        yield store


@pytest.fixture
def observer(etcd: LocalEtcd, prefix: str) -> Iterator[EtcdStore]:
    with EtcdStore(etcd.endpoint, prefix=prefix, timeout=30) as store:
        yield store


def handled(etcd: LocalEtcd) -> dict[str, int]:
    """etcd's count of handled gRPC calls per method (what the JSON gateway forwarded)."""
    text = urllib.request.urlopen(f"{etcd.url}/metrics", timeout=30).read().decode()
    counts: dict[str, int] = {}
    pattern = r'grpc_server_handled_total\{[^}]*grpc_method="(\w+)"[^}]*\} (\S+)'
    for method, value in re.findall(pattern, text):
        counts[method] = counts.get(method, 0) + int(float(value))
    return counts


def watchers(etcd: LocalEtcd) -> int:
    """How many watchers etcd holds now (its gauge ``etcd_debugging_mvcc_watcher_total``)."""
    text = urllib.request.urlopen(f"{etcd.url}/metrics", timeout=30).read().decode()
    found = re.search(r"^etcd_debugging_mvcc_watcher_total (\S+)$", text, re.MULTILINE)
    assert found, "etcd's /metrics has no etcd_debugging_mvcc_watcher_total"
    return int(float(found.group(1)))


def test_joiner_keys_go_out_in_the_transaction_of_its_next_read(
    joiner: RendezvousEtcdStore, observer: EtcdStore, etcd: LocalEtcd
) -> None:
    joiner.session.id()
    before = handled(etcd)
    joiner.set(ROUND + "nodes/0", "me", ephemeral=True)
    joiner.set("rdzv/job/round/1/ctl/expect/0", "1", ephemeral=True)
    assert observer.try_get(ROUND + "nodes/0") is None, "held until the joiner's next request"
    reads = joiner.read_many([ROUND + "ctl/status"], [ROUND + "nodes/"])
    after = handled(etcd)
    assert reads.counts == {ROUND + "nodes/": 1}, "the read sees the joiner's own key"
    assert reads.values == {ROUND + "ctl/status": None}
    assert observer.try_get(ROUND + "nodes/0") == b"me"
    assert observer.try_get("rdzv/job/round/1/ctl/expect/0") == b"1"
    assert after.get("Txn", 0) - before.get("Txn", 0) == 1
    assert after.get("Put", 0) == before.get("Put", 0), "no put of its own"


def test_held_keys_go_before_any_other_request_or_watch(
    joiner: RendezvousEtcdStore, observer: EtcdStore
) -> None:
    joiner.set(ROUND + "nodes/1", "a", ephemeral=True)
    assert joiner.try_get(ROUND + "nodes/1") == b"a"
    joiner.set(ROUND + "back/1", "b", ephemeral=True)
    since = joiner.revision(ROUND + "ctl/")
    assert observer.try_get(ROUND + "back/1") == b"b"
    joiner.set(ROUND + "nodes/2", "c", ephemeral=True)
    joiner.watch(ROUND + "ctl/", since, 0.1)
    assert observer.try_get(ROUND + "nodes/2") == b"c"


def test_other_keys_are_written_at_once(joiner: RendezvousEtcdStore, observer: EtcdStore) -> None:
    joiner.set(ROUND + "user/x", "1", ephemeral=True)
    joiner.set(ROUND + "nodes/3", "2")  # not ephemeral
    assert observer.try_get(ROUND + "user/x") == b"1"
    assert observer.try_get(ROUND + "nodes/3") == b"2"


def test_held_keys_and_a_full_transaction_are_sent_apart(
    joiner: RendezvousEtcdStore, observer: EtcdStore
) -> None:
    joiner.set(ROUND + "nodes/4", "held", ephemeral=True)
    keys = [f"{ROUND}user/{i}" for i in range(128)]
    joiner.multi_set(keys, ["v"] * len(keys))
    assert observer.count_keys(ROUND + "user/") == 128
    assert observer.try_get(ROUND + "nodes/4") == b"held"


def test_a_lost_lease_is_raised_by_the_next_request_then_renewed(
    joiner: RendezvousEtcdStore, observer: EtcdStore
) -> None:
    observer.client.call("lease/revoke", {"ID": joiner.session.id()})
    joiner.set(ROUND + "nodes/5", "x", ephemeral=True)
    with pytest.raises(SessionExpiredError):
        joiner.read_many(counts=[ROUND + "nodes/"])
    joiner.set(ROUND + "nodes/5", "y", ephemeral=True)
    assert joiner.read_many(counts=[ROUND + "nodes/"]).counts == {ROUND + "nodes/": 1}
    assert observer.try_get(ROUND + "nodes/5") == b"y"
    joiner.close()
    assert observer.try_get(ROUND + "nodes/5") is None, "still tied to the (new) lease"


def test_threads_sharing_the_store_each_read_their_own_keys(
    joiner: RendezvousEtcdStore,
) -> None:
    seen: dict[int, int] = {}

    def join(i: int) -> None:
        for attempt in range(10):
            key = f"rdzv/job/round/{i}/nodes/{attempt}"
            joiner.set(key, str(attempt), ephemeral=True)
            count = joiner.read_many(counts=[f"rdzv/job/round/{i}/nodes/"]).counts
            seen[i] = min(seen.get(i, attempt + 1), count[f"rdzv/job/round/{i}/nodes/"] - attempt)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {i: 1 for i in range(8)}, "every read counted the keys its thread had set"


def test_the_watch_that_wakes_a_joiner_brings_its_rank(
    joiner: RendezvousEtcdStore, observer: EtcdStore, etcd: LocalEtcd
) -> None:
    joiner.set(ROUND + "nodes/h:1:b", "descriptor", ephemeral=True)  # names its rank key
    since = joiner.revision(ROUND + "ctl/")
    woke: list[int] = []
    watching = watchers(etcd)
    waiter = threading.Thread(target=lambda: woke.append(joiner.watch(ROUND + "ctl/", since, 60)))
    waiter.start()
    # The watch is in place on etcd: the control dir's and the rank key's watchers.
    eventually(lambda: watchers(etcd) >= watching + 2, 30, "the joiner's watch to be in place")
    observer.multi_set([ROUND + "rank/h:0:a", ROUND + "rank/h:1:b"], ["a", "b"])  # as sealers do past
    observer.set(ROUND + "ctl/status", "s")  # 126 members: ranks first, the status last
    waiter.join(60)
    assert woke and woke[0] > since
    before = handled(etcd)
    assert joiner.try_get(ROUND + "rank/h:1:b") == b"b"
    assert handled(etcd).get("Range", 0) == before.get("Range", 0), "no request for the rank"
    assert joiner.try_get(ROUND + "rank/h:1:b") == b"b", "a second read asks etcd"
    assert joiner.try_get(ROUND + "rank/h:0:a") == b"a"
