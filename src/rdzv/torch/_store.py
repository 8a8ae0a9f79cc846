"""TorchStore: any rdzv Store as a real ``torch.distributed.Store`` (usable by c10d, gloo, torch's agent).

torch calls a Python subclass of ``torch.distributed.Store`` from C++ through a trampoline that
looks methods up by name: ``set``, ``get``, ``add``, ``compare_set``, ``check``, ``wait`` (with and
without a timeout), ``multi_get``, ``multi_set``, ``append``, ``has_extended_api``, ``clone``, and the
C++ names ``deleteKey`` and ``getNumKeys``. :class:`TorchStore` answers all of them, plus the Python
names torch code uses, and keeps rdzv's own extensions (``try_get``, ``list_keys``, ``watch``,
ephemeral keys...) so that it is still an rdzv Store as well.

Errors are torch's as well as rdzv's (:mod:`._errors`): a timeout is a
``torch.distributed.DistStoreError`` and an :class:`~rdzv.errors.StoreTimeoutError`. The
queues (``queue_push``, ``queue_pop``, ``queue_len``) are rdzv's (:class:`rdzv.store.Store`'s own
methods), run through the adapter (a blocking pop waits for torch's timeout).

The blocking calls use the timeout torch keeps in C++ (``TorchStore.timeout``), which torch's
own code may change through a ``PrefixStore`` without calling Python; ``set_timeout`` from Python
also sets the wrapped store's timeout.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import ContextManager, Sequence, cast

import torch.distributed as dist

from ..store import (
    Conditions,
    Reads,
    Store,
    StoreCapabilities,
    Timeout,
    Value,
    check_key,
    to_seconds,
)
from ._errors import torch_errors

logger = logging.getLogger(__name__)


class TorchStore(dist.Store):
    """A ``torch.distributed.Store`` that forwards every call to the rdzv ``store`` it wraps.

    Args:
        store: any rdzv store (HashStore, FileStore, TCPStore, EtcdStore, a PrefixStore view, or
            the store a rendezvous round hands out).

    ``init_process_group(backend="gloo", store=TorchStore(store), rank=..., world_size=...)``
    works as with torch's own stores. Keep a reference to the adapter while torch uses it:
    torch holds only its C++ half, and a Python subclass whose Python object was freed can no
    longer be called (``rdzv.torch.init_process_group`` keeps that reference for you).
    :meth:`close` closes the wrapped store (its ephemeral keys go).
    """

    def __init__(self, store: Store) -> None:
        if isinstance(store, TorchStore):
            store = store.rdzv_store
        if not isinstance(store, Store):
            raise TypeError(
                f"TorchStore wraps an rdzv store (rdzv.store.Store), not {type(store).__name__}; "
                "torch's own stores need no adapter."
            )
        super().__init__()
        self._store = store
        self._clones: list[TorchStore] = []
        dist.Store.set_timeout(self, store.timeout)

    @property
    def rdzv_store(self) -> Store:
        """The rdzv store this adapter forwards to."""
        return self._store

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._store.capabilities

    def _as_queue_store(self) -> Store:
        """This adapter as the rdzv Store it is registered as (for :class:`Store`'s queue
        operations, which then use torch's timeout, the C++ property)."""
        return cast(Store, self)

    def _seconds(self) -> float:
        return self.timeout.total_seconds()  # type: ignore[attr-defined]  # torch's C++ property

    # -- timeouts -------------------------------------------------------------------------------
    def set_timeout(self, timeout: Timeout) -> None:  # type: ignore[override]
        """Set the timeout of blocking calls (seconds or timedelta) here and in the wrapped store."""
        seconds = to_seconds(timeout, self._seconds())
        dist.Store.set_timeout(self, timedelta(seconds=seconds))
        self._store.set_timeout(seconds)

    # -- torch's Store API (also called from C++) -----------------------------------------------
    @torch_errors
    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:  # type: ignore[override]
        self._store.set(key, value, ephemeral=ephemeral)

    @torch_errors
    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self._store._get_blocking([check_key(key)], self._seconds())[0]

    @torch_errors
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:  # type: ignore[override]
        return self._store._get_blocking([check_key(k) for k in keys], self._seconds())

    @torch_errors
    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:  # type: ignore[override]
        self._store.wait(keys, to_seconds(timeout, self._seconds()))

    @torch_errors
    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return self._store.add(key, amount)

    @torch_errors
    def compare_set(  # type: ignore[override]
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        return self._store.compare_set(key, expected, desired, ephemeral=ephemeral)

    @torch_errors
    def check(self, keys: Sequence[str]) -> bool:  # type: ignore[override]
        return self._store.check(keys)

    @torch_errors
    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return self._store.delete_key(key)

    @torch_errors
    def num_keys(self) -> int:  # type: ignore[override]
        return self._store.num_keys()

    deleteKey = delete_key
    """The name torch's C++ trampoline calls."""
    getNumKeys = num_keys
    """The name torch's C++ trampoline calls."""

    @torch_errors
    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:  # type: ignore[override]
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        self._store.multi_set(keys, values)

    @torch_errors
    def multi_set_if(
        self, conditions: Conditions, keys: Sequence[str], values: Sequence[Value]
    ) -> bool:
        """rdzv's conditional write (:meth:`rdzv.store.Store.multi_set_if`) of the base store."""
        return self._store.multi_set_if(conditions, keys, values)

    @torch_errors
    def append(self, key: str, value: Value) -> None:  # type: ignore[override]
        self._store.append(key, value)

    @torch_errors
    def queue_push(self, key: str, value: Value) -> None:  # type: ignore[override]
        Store.queue_push(self._as_queue_store(), key, value)

    @torch_errors
    def queue_pop(self, key: str, block: bool = True) -> bytes:  # type: ignore[override]
        return Store.queue_pop(self._as_queue_store(), key, block)

    @torch_errors
    def queue_len(self, key: str) -> int:  # type: ignore[override]
        return Store.queue_len(self._as_queue_store(), key)

    def has_extended_api(self) -> bool:  # type: ignore[override]
        return True

    def clone(self) -> "TorchStore":  # type: ignore[override]
        """Another adapter on the same wrapped store (kept alive as long as this one)."""
        twin = TorchStore(self._store)
        dist.Store.set_timeout(twin, self.timeout)  # type: ignore[attr-defined]
        self._clones.append(twin)
        return twin

    # -- rdzv's extensions ----------------------------------------------------------------------
    @torch_errors
    def try_get(self, key: str) -> bytes | None:
        return self._store.try_get(key)

    @torch_errors
    def list_keys(self, prefix: str = "") -> dict[str, bytes]:  # type: ignore[override]
        """Every key starting with ``prefix`` and its value (iterating gives the keys, as torch's)."""
        return self._store.list_keys(prefix)

    @torch_errors
    def count_keys(self, prefix: str) -> int:
        return self._store.count_keys(prefix)

    @torch_errors
    def revision(self, path: str = "") -> int:
        return self._store.revision(path)

    @torch_errors
    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        return self._store.watch(path, since, to_seconds(timeout, self._seconds()))

    def batch(self) -> ContextManager[None]:
        return self._store.batch()

    @torch_errors
    def watch_get(
        self, path: str, since: int, key: str, timeout: Timeout = None
    ) -> tuple[int, bytes | None]:
        return self._store.watch_get(path, since, key, to_seconds(timeout, self._seconds()))

    @torch_errors
    def read_many(
        self,
        keys: Sequence[str] = (),
        counts: Sequence[str] = (),
        revisions: Sequence[str] = (),
        lists: Sequence[str] = (),
    ) -> Reads:
        return self._store.read_many(keys, counts, revisions, lists)

    @torch_errors
    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        return self._store._get_blocking(keys, timeout)

    def close(self) -> None:
        """Close the wrapped store."""
        self._store.close()

    def __enter__(self) -> "TorchStore":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TorchStore({self._store!r})"


Store.register(TorchStore)
