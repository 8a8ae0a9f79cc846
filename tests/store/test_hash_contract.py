"""HashStore passes the Store contract (in-process: peers are threads with their own client)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
from store_contract import StoreContract

from rdzv.store import HashStore, Store


class HashStoreFactory:
    """Clients of one fresh HashStore: the first is the store, the others its ``client()``s."""

    def __init__(self) -> None:
        self.clients: list[HashStore] = []

    def new_client(self) -> Store:
        client = self.clients[0].client() if self.clients else HashStore()
        self.clients.append(client)
        return client

    def child_spec(self) -> None:
        return None

    def blocked(self) -> int:
        """The threads waiting in the store: its condition holds one lock for each (CPython's
        ``Condition._waiters``)."""
        if not self.clients:
            return 0
        cond = self.clients[0]._shared.cond
        with cond:
            return len(cond._waiters)  # type: ignore[attr-defined]

    def bad_constructions(self) -> list[tuple[Callable[[], Any], type, str]]:
        return [(lambda: HashStore(timeout=-1), ValueError, "timeout must be >= 0"),
                (lambda: HashStore(timeout="soon"), ValueError, "could not convert")]  # type: ignore[arg-type]

    def close(self) -> None:
        for client in self.clients:
            client.close()


class TestHashStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> Iterator[HashStoreFactory]:
        factory = HashStoreFactory()
        yield factory
        factory.close()
