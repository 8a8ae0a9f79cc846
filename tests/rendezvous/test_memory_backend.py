"""The rendezvous contract on the memory backend: handlers of this process on one HashStore."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from _nodes import ThreadNode
from _waiting import eventually
from rendezvous_contract import RendezvousContract

from rdzv.rendezvous import RendezvousParameters, get_rendezvous_handler
from rdzv.rendezvous._engine import DynamicRendezvousHandler
from rdzv.rendezvous._layout import (
    Decision,
    RunKeys,
    decode_rank,
    encode_decision,
    encode_ranks,
    seal_of,
)
from rdzv.rendezvous._memory import shared_store
from rdzv.store import HashStore

_endpoints = itertools.count()


class MemoryCluster:
    backend = "memory"
    processes = False
    hung_options = None

    def __init__(self) -> None:
        self.endpoint = f"memory-test-{next(_endpoints)}"
        self.nodes: list[ThreadNode] = []

    def node(self, min_nodes: int, max_nodes: int, run_id: str = "job", **options) -> ThreadNode:
        options.setdefault("join_timeout", 60.0)
        params = RendezvousParameters(self.backend, self.endpoint, run_id, min_nodes, max_nodes,
                                      **options)
        node = ThreadNode(get_rendezvous_handler(params))
        self.nodes.append(node)
        return node

    def raw_store(self):
        return shared_store(self.endpoint).client()

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class TestMemoryBackend(RendezvousContract):
    @pytest.fixture
    def cluster(self):
        cluster = MemoryCluster()
        yield cluster
        cluster.close()


def test_a_rank_record_of_another_decision_than_the_status_is_never_taken():
    """Where a store cannot fence the seal, a stale sealer's write may leave a joiner a rank
    record of another decision than the round's status. The joiner does not take that rank
    (it would train in a group that does not exist): it is late for the round and forms the
    next one with the others."""
    endpoint = f"memory-test-{next(_endpoints)}"
    params = RendezvousParameters("memory", endpoint, "job", 2, 2, join_timeout=60.0)
    joiner = ThreadNode(get_rendezvous_handler(params))
    store, keys = shared_store(endpoint).client(), RunKeys("job")
    try:
        pending = joiner.request("next")
        eventually(lambda: store.count_keys(keys.nodes(0)) == 1, 30, "the joiner waits")
        me = joiner.handler.node_id
        stale = Decision(2, "10.0.0.9", 1, seal_of("stale", {me: 1, "z": 0}, "10.0.0.9", 1))
        real = Decision(2, "10.0.0.1", 2, seal_of("real", {"x": 0, "y": 1}, "10.0.0.1", 2))
        store.set(keys.rank(0, me), encode_ranks({me: 1}, stale)[me])
        store.multi_set([keys.status(0), keys.sealed], [encode_decision(real), b"0"])
        eventually(lambda: store.count_keys(keys.nodes(1)) == 1, 30, "the joiner is in round 1")
        assert not pending.done(), "the joiner took a rank of round 0"
        other = ThreadNode(get_rendezvous_handler(params))
        other_pending = other.request("next")
        results = [pending.result(30), other_pending.result(30)]
        assert sorted(r["rank"] for r in results) == [0, 1]
        assert {r["world_size"] for r in results} == {2}
        assert "10.0.0.9" not in {r["addr"] for r in results}
    finally:
        store.close()


class _FewWritesAtOnce(HashStore):
    """A store that, like etcd (128 operations a transaction), writes at most a few keys in one
    atomic step: a longer conditional write goes in several."""

    capabilities = replace(HashStore.capabilities, atomic_writes=5)


@pytest.mark.parametrize("store_class, fenced", [(HashStore, True), (_FewWritesAtOnce, False)],
                         ids=["one-step", "several-steps"])
def test_a_decision_written_in_several_steps_makes_its_members_read_the_status(
    store_class: type[HashStore], fenced: bool
) -> None:
    """A rank record marked "fenced" is taken without reading the round's status, which is
    only safe if the whole decision was one atomic write. Where it takes several (etcd, above
    124 nodes), the records say they are not fenced: a member woken between two steps reads
    the status, and waits for it, instead of taking a decision that may never complete."""
    store = store_class()
    handlers = [DynamicRendezvousHandler(store, "job", 2, 2, backend="memory") for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        infos = list(pool.map(lambda handler: handler.next_rendezvous(), handlers))
    assert sorted(info.rank for info in infos) == [0, 1]
    keys = RunKeys("job")
    for handler in handlers:
        rank_key = keys.rank(0, handler.node_id)
        assert decode_rank(rank_key, store.get(rank_key))[1].fenced is fenced
        handler.shutdown()
