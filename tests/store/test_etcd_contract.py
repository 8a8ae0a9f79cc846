"""EtcdStore passes the Store contract against a real etcd (each version installed).

One etcd runs per version for the whole session; each test gets a fresh key prefix on it, and
"other process" peers are ``_child.py`` processes with their own EtcdStore.
"""

from __future__ import annotations

import os
import re
import sys
import urllib.request
import uuid
from typing import Any, Callable, Iterator

import pytest
from store_contract import StoreContract

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "etcd"))
from etcd_testing import etcd_params, require_etcd  # noqa: E402

from rdzv.etcd import LocalEtcd  # noqa: E402
from rdzv.store import EtcdStore, Store  # noqa: E402

CHILD_SESSION_TTL = 2.0


@pytest.fixture(scope="session", params=etcd_params())
def etcd_server(request: pytest.FixtureRequest) -> Iterator[LocalEtcd]:
    with LocalEtcd(binary=require_etcd(request.param)) as server:
        yield server


class EtcdStoreFactory:
    """Clients of one fresh key prefix on a shared etcd."""

    session_ttl = CHILD_SESSION_TTL

    def __init__(self, server: LocalEtcd) -> None:
        self.metrics_url = f"{server.url}/metrics"
        self.kwargs: dict[str, Any] = {
            "endpoints": server.endpoint,
            "prefix": f"contract-{uuid.uuid4().hex[:12]}/",
            "session_ttl": CHILD_SESSION_TTL,
        }
        self.clients: list[EtcdStore] = []

    def new_client(self) -> Store:
        client = EtcdStore(**self.kwargs)
        self.clients.append(client)
        return client

    def child_spec(self) -> dict[str, Any]:
        return {"factory": "rdzv.store:EtcdStore", "kwargs": self.kwargs}

    def blocked(self) -> int:
        """The watch streams etcd has opened so far: a blocking call opens one once it has
        read what it waits for in vain (a counter: the end of an earlier watch does not
        lower it, as it lowers etcd's count of watchers with a lag)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=30).read().decode()
        found = re.search(r'^grpc_server_started_total\{[^}]*grpc_method="Watch"[^}]*\} (\S+)$',
                          text, re.MULTILINE)
        assert found, "etcd's /metrics has no grpc_server_started_total of Watch"
        return int(float(found.group(1)))

    def bad_constructions(self) -> list[tuple[Callable[[], Any], type, str]]:
        endpoint = self.kwargs["endpoints"]
        return [
            (lambda: EtcdStore("~:2379"), ValueError, "The hostname of the rendezvous endpoint '~:2379'"),
            (lambda: EtcdStore("h:"), ValueError, "The port number of the rendezvous endpoint 'h:'"),
            (lambda: EtcdStore(endpoint, prefix=None), TypeError, "prefix must be str"),  # type: ignore[arg-type]
            (lambda: EtcdStore(endpoint, timeout=-1), ValueError, "timeout must be >= 0"),
        ]

    def close(self) -> None:
        for client in self.clients:
            client.close()


class TestEtcdStore(StoreContract):
    @pytest.fixture
    def store_factory(self, etcd_server: LocalEtcd) -> Iterator[EtcdStoreFactory]:
        factory = EtcdStoreFactory(etcd_server)
        yield factory
        factory.close()

    def test_keys_live_under_the_prefix(
        self, store_factory: EtcdStoreFactory, etcd_server: LocalEtcd
    ) -> None:
        store = store_factory.new_client()
        store.set("k", "v")
        whole = EtcdStore(etcd_server.endpoint)
        try:
            assert whole.get(store_factory.kwargs["prefix"] + "k") == b"v"
            assert whole.num_keys() > store.num_keys() == 1
        finally:
            whole.close()
