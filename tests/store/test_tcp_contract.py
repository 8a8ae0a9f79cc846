"""TCPStore passes the Store contract against a fresh in-process StoreServer per test; peers
are real child processes with TCPStore clients of their own."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from store_contract import StoreContract

from rdzv.server import StoreServer
from rdzv.store import Store, TCPStore

SESSION_TTL = 2.0


class TCPStoreFactory:
    """Clients of one fresh StoreServer (served from a thread of the test process)."""

    session_ttl = SESSION_TTL

    def __init__(self, **server_options: Any) -> None:
        self.server = StoreServer("127.0.0.1", 0, **server_options).start()
        self.secret = server_options.get("secret")
        self.clients: list[TCPStore] = []

    def new_client(self) -> Store:
        client = TCPStore(
            "127.0.0.1", self.server.port, timeout=30, session_ttl=SESSION_TTL, secret=self.secret
        )
        self.clients.append(client)
        return client

    def child_spec(self) -> dict[str, Any]:
        kwargs = {
            "host_name": "127.0.0.1",
            "port": self.server.port,
            "timeout": 30,
            "session_ttl": SESSION_TTL,
        }
        if self.secret is not None:
            kwargs["secret"] = self.secret
        return {"factory": "rdzv.store:TCPStore", "kwargs": kwargs}

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.server.stop()


class TestTCPStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> Iterator[TCPStoreFactory]:
        factory = TCPStoreFactory()
        yield factory
        factory.close()


class TestTCPStoreAuthenticated(StoreContract):
    """The same contract with a shared secret on both sides."""

    @pytest.fixture
    def store_factory(self) -> Iterator[TCPStoreFactory]:
        factory = TCPStoreFactory(secret="contract-secret")
        yield factory
        factory.close()


class TestTCPStoreDurable(StoreContract):
    """The same contract against a server that logs every write to a data dir."""

    @pytest.fixture
    def store_factory(self, tmp_path: Any) -> Iterator[TCPStoreFactory]:
        factory = TCPStoreFactory(data_dir=tmp_path / "data", fsync="always")
        yield factory
        factory.close()
