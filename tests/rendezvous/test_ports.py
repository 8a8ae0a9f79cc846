"""The bootstrap port a round hands out is reserved for its workers: no bind race."""

from __future__ import annotations

import socket

import pytest

from rdzv.rendezvous import get_rendezvous_handler
from rdzv.server import StoreServer
from rdzv.store import TCPStore


def test_the_bootstrap_port_is_held_until_the_workers_bind_it() -> None:
    handler = get_rendezvous_handler("memory://ports-job?min_nodes=1&max_nodes=1")
    try:
        info = handler.next_rendezvous()
        port = info.bootstrap_store_info.master_port
        # No one else gets it: not as an ephemeral port, not with a plain bind.
        handed_out = set()
        for _ in range(2000):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                handed_out.add(probe.getsockname()[1])
        assert port not in handed_out
        with socket.socket() as intruder, pytest.raises(OSError):
            intruder.bind(("127.0.0.1", port))
        # The workers' store (any server binding with SO_REUSEADDR) listens on it all the same.
        with StoreServer("127.0.0.1", port) as server:
            client = TCPStore("127.0.0.1", server.port, timeout=10)
            client.set("master", "up")
            assert client.get("master") == b"up"
            client.close()
    finally:
        handler.shutdown()
