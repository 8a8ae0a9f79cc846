"""Fixtures of the server tests: a store server in this process and a client of it."""

from __future__ import annotations

from typing import Iterator

import pytest

from rdzv.server import StoreServer
from rdzv.store import TCPStore


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer("127.0.0.1", 0) as running:
        yield running


@pytest.fixture
def store(server: StoreServer) -> Iterator[TCPStore]:
    client = TCPStore("127.0.0.1", server.port, timeout=30)
    yield client
    client.close()
