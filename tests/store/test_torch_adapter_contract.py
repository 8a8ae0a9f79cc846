"""TorchStore (rdzv.torch) passes the Store contract: directly, and with torch's methods called from C++.

``TestTorchStoreThroughC10d`` drives the adapter the way torch does: every torch method goes
through torch's own C++ ``PrefixStore``, whose calls reach the adapter through torch's trampoline
(``deleteKey``, ``getNumKeys``, the ``wait`` overloads, bytes values). Peers in other processes use
an adapter of their own over a TCPStore client.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import pytest

dist = pytest.importorskip("torch.distributed")

from _child import load_factory  # noqa: E402
from store_contract import StoreContract  # noqa: E402
from test_hash_contract import HashStoreFactory  # noqa: E402
from test_tcp_contract import TCPStoreFactory  # noqa: E402

from rdzv.store import Store  # noqa: E402
from rdzv.store._base import Conditions, Timeout, Value, check_key, to_bytes, to_seconds  # noqa: E402
from rdzv.torch import TorchStore  # noqa: E402

PREFIX = "tenant"


def adapter_client(factory: str, kwargs: dict[str, Any]) -> TorchStore:
    """A child process's client: ``TorchStore`` over the base store ``factory(**kwargs)``."""
    return TorchStore(load_factory(factory)(**kwargs))


class C10dView(Store):
    """rdzv's Store API over a TorchStore; torch's methods go through torch's C++ PrefixStore."""

    def __init__(self, adapter: TorchStore) -> None:
        self.adapter = adapter
        self.c10d = dist.PrefixStore(PREFIX, adapter)
        self.capabilities = adapter.capabilities  # type: ignore[misc]

    def _k(self, key: str) -> str:
        return f"{PREFIX}/{check_key(key)}"

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self.c10d.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self.adapter.set_timeout(timeout)

    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        if ephemeral:
            self.adapter.set(self._k(key), value, ephemeral=True)
        else:
            self.c10d.set(check_key(key), to_bytes(value))

    def get(self, key: str) -> bytes:
        return self.c10d.get(check_key(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self.c10d.multi_get([check_key(k) for k in keys])

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        seconds = to_seconds(timeout, self.timeout.total_seconds())
        self.c10d.wait([check_key(k) for k in keys], timedelta(seconds=seconds))

    def add(self, key: str, amount: int) -> int:
        return self.c10d.add(check_key(key), amount)

    def compare_set(self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False) -> bytes:
        if ephemeral:
            return self.adapter.compare_set(self._k(key), expected, desired, ephemeral=True)
        return self.c10d.compare_set(check_key(key), to_bytes(expected), to_bytes(desired))

    def check(self, keys: Sequence[str]) -> bool:
        return self.c10d.check([check_key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self.c10d.delete_key(check_key(key))

    def num_keys(self) -> int:
        return self.c10d.num_keys()

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self.c10d.multi_set([check_key(k) for k in keys], [to_bytes(v) for v in values])

    def append(self, key: str, value: Value) -> None:
        self.c10d.append(check_key(key), to_bytes(value))

    # torch's C++ trampoline of a Python store forwards no queue call (a c10d PrefixStore over
    # any Python store raises NotImplementedError): the queues are the adapter's own methods.
    def queue_push(self, key: str, value: Value) -> None:
        self.adapter.queue_push(self._k(key), value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self.adapter.queue_pop(self._k(key), block)

    def queue_len(self, key: str) -> int:
        return self.adapter.queue_len(self._k(key))

    def try_get(self, key: str) -> bytes | None:
        return self.adapter.try_get(self._k(key))

    def multi_set_if(self, conditions: Conditions, keys: Sequence[str], values: Sequence[Value]) -> bool:
        return self.adapter.multi_set_if(
            {self._k(k): v for k, v in conditions.items()}, [self._k(k) for k in keys], values
        )

    def list_keys(self, prefix: str) -> dict[str, bytes]:
        cut = len(PREFIX) + 1
        return {k[cut:]: v for k, v in self.adapter.list_keys(f"{PREFIX}/{prefix}").items()}

    def count_keys(self, prefix: str) -> int:
        return self.adapter.count_keys(f"{PREFIX}/{prefix}")

    def revision(self, path: str = "") -> int:
        return self.adapter.revision(f"{PREFIX}/{path}")

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        return self.adapter.watch(f"{PREFIX}/{path}", since, timeout)

    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        return self.adapter._get_blocking([self._k(k) for k in keys], timeout)

    def close(self) -> None:
        self.adapter.close()


class AdapterFactory:
    """Clients of a base store factory, each wrapped in a TorchStore (and a C10dView if asked)."""

    def __init__(self, base: Any, through_c10d: bool = False) -> None:
        self.base = base
        self.through_c10d = through_c10d
        self.session_ttl = getattr(base, "session_ttl", None)

    def new_client(self) -> Store:
        adapter = TorchStore(self.base.new_client())
        client = C10dView(adapter) if self.through_c10d else adapter
        client.raises_torch_errors = True  # type: ignore[attr-defined]  # (see the contract)
        return client

    def bad_constructions(self) -> list[tuple[Callable[[], Any], type, str]]:
        return [
            (lambda: TorchStore(None), TypeError, "TorchStore wraps an rdzv store"),  # type: ignore[arg-type]
            (lambda: TorchStore(dist.HashStore()), TypeError, "torch's own stores need no adapter"),
            *self.base.bad_constructions(),
        ]

    def child_spec(self) -> dict[str, Any] | None:
        spec = self.base.child_spec()
        if spec is None:
            return None
        wrapped = {"factory": "test_torch_adapter_contract:adapter_client", "kwargs": spec,
                   "warm": True}  # (forked from a process that imported torch once)
        return {**wrapped, "prefix": PREFIX} if self.through_c10d else wrapped

    def blocked(self) -> int:
        return self.base.blocked()


class TestTorchStoreOverHashStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> Iterator[AdapterFactory]:
        base = HashStoreFactory()
        yield AdapterFactory(base)
        base.close()


class TestTorchStoreOverTCPStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> Iterator[AdapterFactory]:
        base = TCPStoreFactory()
        yield AdapterFactory(base)
        base.close()


class TestTorchStoreThroughC10d(StoreContract):
    @pytest.fixture
    def store_factory(self) -> Iterator[AdapterFactory]:
        base = TCPStoreFactory()
        yield AdapterFactory(base, through_c10d=True)
        base.close()
