"""The rendezvous contract on the memory backend: handlers of this process on one HashStore."""

from __future__ import annotations

import itertools

import pytest

from _nodes import ThreadNode
from rendezvous_contract import RendezvousContract

from rdzv.rendezvous import RendezvousParameters, get_rendezvous_handler
from rdzv.rendezvous._memory import shared_store

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
