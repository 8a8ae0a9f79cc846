"""What every dynamic backend (tcp, etcd, file, memory) shares: its handler, the engine over the
backend's store, configured by the backend's validated parameters."""

from __future__ import annotations

from typing import Callable

from ..store import Store
from ._api import RendezvousParameters
from ._engine import DynamicRendezvousHandler


def dynamic_handler(
    store: Store,
    params: RendezvousParameters,
    *,
    on_shutdown: Callable[[], None] | None,
    query_store: Callable[[], Store] | None = None,
    local_addr: str | None = None,
) -> DynamicRendezvousHandler:
    """A handler over ``store`` configured by a backend's validated ``params``;
    ``on_shutdown`` releases what the backend opened, ``query_store`` opens further clients
    (see :class:`DynamicRendezvousHandler`)."""
    return DynamicRendezvousHandler(
        store,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        backend=params.backend,
        local_addr=params.local_addr or local_addr,
        join_timeout=params.get_option("join_timeout"),
        last_call_timeout=params.get_option("last_call_timeout"),
        close_timeout=params.get_option("close_timeout"),
        history_size=params.get_option("history_size"),
        node_order=params.get_option("node_order"),
        on_shutdown=on_shutdown,
        query_store=query_store,
    )
