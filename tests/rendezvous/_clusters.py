"""Clusters of process nodes for the contract suite (backends whose store processes share)."""

from __future__ import annotations

from typing import Any, Callable

from _child_process import end_together
from _nodes import ProcessNode

from rdzv.store import Store


class ProcessCluster:
    """Nodes in child processes of one backend endpoint; every node is stopped at teardown."""

    processes = True

    def __init__(self, backend: str, endpoint: str, raw_store: Callable[[], Store],
                 hung_options: dict[str, Any] | None, **defaults: Any) -> None:
        self.backend = backend
        self.endpoint = endpoint
        self.hung_options = hung_options
        self._raw_store = raw_store
        self._defaults = defaults
        self.nodes: list[ProcessNode] = []
        self._stores: list[Store] = []

    def node(self, min_nodes: int, max_nodes: int, run_id: str = "job",
             **options: Any) -> ProcessNode:
        spec = {"backend": self.backend, "endpoint": self.endpoint, "run_id": run_id,
                "min_nodes": min_nodes, "max_nodes": max_nodes, "local_addr": "127.0.0.1",
                "join_timeout": 60.0, **self._defaults, **options}
        node = ProcessNode(spec)
        self.nodes.append(node)
        node.wait_ready()
        return node

    def raw_store(self) -> Store:
        store = self._raw_store()
        self._stores.append(store)
        return store

    def close(self) -> None:
        end_together(list(self.nodes))
        for store in self._stores:
            store.close()
