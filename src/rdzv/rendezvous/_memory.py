"""The ``memory`` backend: dynamic rendezvous on a HashStore shared by the handlers of one process.

Each handler gets its own client of the process-wide store for its endpoint (its own session),
so closing a handler removes its liveness keys as a dead node's connection would. For tests and
single-process simulations.
"""

from __future__ import annotations

import threading

from ..store import HashStore
from ._api import RendezvousParameters
from ._backend import dynamic_handler
from ._engine import DynamicRendezvousHandler

_stores: dict[str, HashStore] = {}
_stores_lock = threading.Lock()


def shared_store(endpoint: str) -> HashStore:
    """The process-wide HashStore of ``endpoint`` (created on first use)."""
    with _stores_lock:
        store = _stores.get(endpoint)
        if store is None:
            store = _stores[endpoint] = HashStore()
        return store


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """A handler whose store is a new client of the endpoint's shared HashStore."""
    store = shared_store(params.endpoint).client()
    store.set_timeout(params.get_option("read_timeout"))
    return dynamic_handler(
        store, params, on_shutdown=store.close, local_addr="127.0.0.1"
    )
