"""TCPStore passes the Store contract against a fresh in-process StoreServer per test; peers
are real child processes with TCPStore clients of their own."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import pytest
from _waiting import eventually
from store_contract import StoreContract

from rdzv.errors import StoreConnectionError, StoreError
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

    def blocked(self) -> int:
        """The requests waiting in the server (blocking gets, waits, watches), per path."""
        core = self.server._core
        assert core is not None
        return sum(len(list(waiting)) for waiting in list(core.waiters.values()))

    def bad_constructions(self) -> list[tuple[Callable[[], Any], type, str]]:
        port = self.server.port  # (reachable: a check that came late would connect and pass)
        return [
            (lambda: TCPStore("127.0.0.1", port, world_size=0), ValueError,
             "TCPStore world size cannot be 0"),
            (lambda: TCPStore("127.0.0.1", port, world_size=-2), ValueError,
             "world size must be positive or -1"),
            (lambda: TCPStore("127.0.0.1", 70000), ValueError,
             "TCPStore port must be an integer between 0 and 65535, got 70000"),
            (lambda: TCPStore("127.0.0.1", "29400"), TypeError, "port must be an int, not str"),  # type: ignore[arg-type]
            (lambda: TCPStore("127.0.0.1", 0), ValueError, "port 0 picks a free port for a master"),
            (lambda: TCPStore("~", port), ValueError, "host name '~' must be a dot-separated list"),
            (lambda: TCPStore("dummy.com ", port), ValueError, "host name 'dummy.com ' must be"),
            (lambda: TCPStore("", port), ValueError, "host name '' must be"),
            (lambda: TCPStore("127.0.0.1", port, timeout=-1), ValueError, "timeout must be >= 0"),
            (lambda: TCPStore("127.0.0.1", port, session_ttl=-1), ValueError, "session_ttl"),
            (lambda: TCPStore("127.0.0.1", port, master_listen_fd=-1), ValueError,
             "master_listen_fd must be a file descriptor"),
        ]

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


def test_multi_tenant_masters_of_a_port_share_one_server() -> None:
    """As torch's: in one process, every TCPStore(host, port, is_master=True,
    multi_tenant=True) of a port uses one server, which stops when the last of them closes;
    a master without multi_tenant on that port finds the address in use."""
    first = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=5)
    port = first.port
    second = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=5)
    try:
        assert second.server is first.server
        first.set("k", "from first")
        assert second.get("k") == b"from first"
        with pytest.raises(OSError, match="Address already in use"):
            TCPStore("127.0.0.1", port, is_master=True, timeout=5)
        first.close()
        second.set("k", "still served")
        assert second.get("k") == b"still served"
    finally:
        first.close()
        second.close()
    with pytest.raises(StoreConnectionError, match="connection refused"):
        TCPStore("127.0.0.1", port, timeout=0.5)


def test_close_cuts_short_another_threads_blocking_get_and_still_ends_the_session() -> None:
    """A node that stops while a thread of it waits in the store (a rendezvous formed in the
    background) stops at once: close() does not wait out the wait's slice on the server (a
    keepalive period, 10 s with this ttl). The waiting call raises StoreError; the session
    still ends at once, so its ephemeral keys go now, not when the 30 s ttl runs out."""
    factory = TCPStoreFactory()
    waiter = TCPStore("127.0.0.1", factory.server.port, timeout=60, session_ttl=30)
    try:
        observer = factory.new_client()
        waiter.set("alive", "1", ephemeral=True)
        outcome: list[BaseException | bytes] = []

        def wait_for_a_key_never_set() -> None:
            try:
                outcome.append(waiter.get("never"))  # (waits up to the 60 s timeout)
            except StoreError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=wait_for_a_key_never_set)
        thread.start()
        eventually(lambda: factory.blocked() == 1, 10, "the get waiting in the server")
        started = time.monotonic()
        waiter.close()
        closed_in = time.monotonic() - started
        thread.join(10)
        assert not thread.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], StoreError) and "is closed" in str(outcome[0]), outcome
        assert observer.try_get("alive") is None  # the session ended with the close
        assert closed_in < 5.0, closed_in  # (10 s, the slice, before)
    finally:
        waiter.close()
        factory.close()
