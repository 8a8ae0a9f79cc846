"""PrefixStore: a view of another store in which every key is put under ``prefix + "/"``."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from ._base import Conditions, Reads, Store, Timeout, Value, check_key


class PrefixStore(Store):
    """torch's ``PrefixStore(prefix, store)``: the keys of this view live under ``prefix/``.

    ``num_keys`` counts the keys under the prefix when the underlying store can list by prefix
    (torch's counts the whole underlying store).
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"the PrefixStore prefix must be a str, not {type(prefix).__name__}")
        if store is None:  # (torch's words and class)
            raise ValueError(
                f"store argument cannot be None: PrefixStore({prefix!r}, store) puts its keys in "
                f"another store, e.g. PrefixStore({prefix!r}, TCPStore(host, port))"
            )
        if not isinstance(store, Store):
            raise TypeError(
                f"PrefixStore({prefix!r}, store) needs an rdzv store (rdzv.store.Store) to put "
                f"the keys in, got {type(store).__name__}: pass e.g. PrefixStore({prefix!r}, "
                "TCPStore(host, port))"
            )
        super().__init__(store.timeout)
        self.prefix = prefix
        self.underlying_store = store
        self._head = prefix + "/"
        self.capabilities = store.capabilities  # type: ignore[misc]

    def _k(self, key: str) -> str:
        return self._head + check_key(key)

    def _path(self, path: str) -> str:
        return self._head + path

    @property
    def timeout(self):  # type: ignore[override]
        return self.underlying_store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self.underlying_store.set_timeout(timeout)

    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        self.underlying_store.set(self._k(key), value, ephemeral=ephemeral)

    def get(self, key: str) -> bytes:
        return self.underlying_store.get(self._k(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self.underlying_store.multi_get([self._k(k) for k in keys])

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        self.underlying_store.wait([self._k(k) for k in keys], timeout)

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        return self.underlying_store.compare_set(
            self._k(key), expected, desired, ephemeral=ephemeral
        )

    def check(self, keys: Sequence[str]) -> bool:
        return self.underlying_store.check([self._k(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self._k(key))

    def num_keys(self) -> int:
        if self.capabilities.listing:
            return self.underlying_store.count_keys(self._head)
        return self.underlying_store.num_keys()

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self.underlying_store.multi_set([self._k(k) for k in keys], values)

    def multi_set_if(
        self, conditions: Conditions, keys: Sequence[str], values: Sequence[Value]
    ) -> bool:
        return self.underlying_store.multi_set_if(
            {self._k(k): v for k, v in conditions.items()}, [self._k(k) for k in keys], values
        )

    def append(self, key: str, value: Value) -> None:
        self.underlying_store.append(self._k(key), value)

    def try_get(self, key: str) -> bytes | None:
        return self.underlying_store.try_get(self._k(key))

    def list_keys(self, prefix: str) -> dict[str, bytes]:
        cut = len(self._head)
        return {k[cut:]: v for k, v in self.underlying_store.list_keys(self._path(prefix)).items()}

    def count_keys(self, prefix: str) -> int:
        return self.underlying_store.count_keys(self._path(prefix))

    def revision(self, path: str = "") -> int:
        return self.underlying_store.revision(self._path(path))

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        return self.underlying_store.watch(self._path(path), since, timeout)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        with self.underlying_store.batch():
            yield

    def watch_get(
        self, path: str, since: int, key: str, timeout: Timeout = None
    ) -> tuple[int, bytes | None]:
        return self.underlying_store.watch_get(self._path(path), since, self._k(key), timeout)

    def read_many(
        self,
        keys: Sequence[str] = (),
        counts: Sequence[str] = (),
        revisions: Sequence[str] = (),
        lists: Sequence[str] = (),
    ) -> Reads:
        cut = len(self._head)
        reads = self.underlying_store.read_many(
            [self._k(k) for k in keys], [self._path(p) for p in counts],
            [self._path(p) for p in revisions], [self._path(p) for p in lists],
        )
        return Reads(
            {k[cut:]: v for k, v in reads.values.items()},
            {p[cut:]: n for p, n in reads.counts.items()},
            {p[cut:]: r for p, r in reads.revisions.items()},
            {p[cut:]: {k[cut:]: v for k, v in items.items()} for p, items in reads.lists.items()},
        )

    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        return self.underlying_store._get_blocking([self._k(k) for k in keys], timeout)

    def close(self) -> None:
        """A prefix view owns nothing: closing it leaves the underlying store open."""
