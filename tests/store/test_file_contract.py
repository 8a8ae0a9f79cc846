"""FileStore passes the Store contract, with peers in real child processes sharing one file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from contract import StoreContract

from rdzv.store import FileStore, Store

SESSION_TTL = 2.0


class FileStoreFactory:
    """Clients of one fresh store file in a test's temporary directory."""

    session_ttl = SESSION_TTL

    def __init__(self, path: Path, **options: Any) -> None:
        self.path = path
        self.options = {"session_ttl": SESSION_TTL, **options}
        self.clients: list[FileStore] = []

    def new_client(self) -> Store:
        client = FileStore(self.path, timeout=30, **self.options)
        self.clients.append(client)
        return client

    def child_spec(self) -> dict[str, Any]:
        return {"factory": "rdzv.store:FileStore", "kwargs": {"file_name": str(self.path), **self.options}}

    def close(self) -> None:
        for client in self.clients:
            client.close()


class TestFileStore(StoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[FileStoreFactory]:
        factory = FileStoreFactory(tmp_path / "store")
        yield factory
        factory.close()


class TestFileStoreCompacting(StoreContract):
    """The same contract while the log is compacted every few KiB."""

    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[FileStoreFactory]:
        factory = FileStoreFactory(tmp_path / "store", compact_bytes=2048)
        yield factory
        factory.close()
