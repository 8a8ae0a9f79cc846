"""PrefixStore passes the Store contract over an in-process store, with keys kept under its prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from store_contract import StoreContract
from test_file_contract import FileStoreFactory
from test_hash_contract import HashStoreFactory

from rdzv.store import HashStore, PrefixStore, Store

PREFIX = "tenant"


class PrefixedFactory:
    """Clients of a fresh store, each seen through ``PrefixStore(PREFIX, client)``."""

    def __init__(self, base: HashStoreFactory | FileStoreFactory) -> None:
        self.base = base
        self.views: list[PrefixStore] = []
        self.session_ttl = getattr(base, "session_ttl", None)

    def new_client(self) -> Store:
        view = PrefixStore(PREFIX, self.base.new_client())
        self.views.append(view)
        return view

    def child_spec(self) -> dict[str, Any] | None:
        spec = self.base.child_spec()
        return None if spec is None else {**spec, "prefix": PREFIX}

    def blocked(self) -> int:
        return self.base.blocked()

    def bad_constructions(self) -> list[tuple[Callable[[], Any], type, str]]:
        """torch's PrefixStore(p, None) raises ValueError("store argument cannot be None")."""
        return [
            (lambda: PrefixStore(PREFIX, None), ValueError, "^store argument cannot be None"),  # type: ignore[arg-type]
            (lambda: PrefixStore(PREFIX, "host:29400"), TypeError, "needs an rdzv store"),  # type: ignore[arg-type]
            (lambda: PrefixStore(None, HashStore()), TypeError, "prefix must be a str"),  # type: ignore[arg-type]
        ]


class PrefixContract(StoreContract):
    """The contract through a PrefixStore view, plus where its keys really live."""

    def test_keys_live_under_the_prefix(self, store_factory: PrefixedFactory) -> None:
        view = store_factory.new_client()
        view.set("k", "v")
        underlying = store_factory.views[0].underlying_store
        assert underlying.get(f"{PREFIX}/k") == b"v"
        assert underlying.try_get("k") is None



class TestPrefixOverHashStore(PrefixContract):
    @pytest.fixture
    def store_factory(self) -> Iterator[PrefixedFactory]:
        base = HashStoreFactory()
        yield PrefixedFactory(base)
        base.close()


class TestPrefixOverFileStore(PrefixContract):
    """Over a multi-process store: child processes use the same prefix (``_child.py`` wraps)."""

    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Iterator[PrefixedFactory]:
        base = FileStoreFactory(tmp_path / "store")
        yield PrefixedFactory(base)
        base.close()
