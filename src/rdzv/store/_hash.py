"""HashStore: a store inside one process, shared by its threads.

``HashStore()`` creates an empty store; :meth:`HashStore.client` opens another handle on the same
data with a session of its own, so that in-process tests can model several clients: closing a
handle deletes the ephemeral keys it wrote, as a dead process's connection would.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from ..errors import StoreTimeoutError
from ..kv import KVState
from ._base import (
    DEFAULT_TIMEOUT,
    Conditions,
    Store,
    StoreCapabilities,
    Timeout,
    Value,
    check_key,
    check_conditional_write,
    to_bytes,
    to_seconds,
)


class _Shared:
    """The data and the wake-up condition that all handles of one HashStore share."""

    def __init__(self) -> None:
        self.state = KVState()
        self.cond = threading.Condition()


class HashStore(Store):
    """An in-process store (torch's ``HashStore``), thread safe, with watch and sessions."""

    capabilities = StoreCapabilities(
        watch=True, ephemeral=True, listing=True, multi_process=False, conditional=True
    )

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT, *, _shared: _Shared | None = None) -> None:
        super().__init__(timeout)
        self._shared = _shared or _Shared()
        with self._shared.cond:
            self._session = self._shared.state.open_session(0.0)
        self._closed = False

    def client(self) -> "HashStore":
        """Another handle on the same data, with its own session."""
        return HashStore(self._timeout, _shared=self._shared)

    # -- writes -----------------------------------------------------------------------------
    def _mutate(self, changed: list[str]) -> None:
        if changed:
            self._shared.cond.notify_all()

    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        data = to_bytes(value)
        with self._shared.cond:
            self._mutate(self._shared.state.set(check_key(key), data, self._owner(ephemeral)))

    def add(self, key: str, amount: int) -> int:
        with self._shared.cond:
            result, changed = self._shared.state.add(check_key(key), int(amount))
            self._mutate(changed)
            return result

    def compare_set(
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        exp, des = to_bytes(expected), to_bytes(desired)
        with self._shared.cond:
            result, changed = self._shared.state.compare_set(
                check_key(key), exp, des, self._owner(ephemeral)
            )
            self._mutate(changed)
            return result

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        data = [to_bytes(v) for v in values]
        with self._shared.cond:
            self._mutate(self._shared.state.multi_set([check_key(k) for k in keys], data))

    def multi_set_if(
        self, conditions: Conditions, keys: Sequence[str], values: Sequence[Value]
    ) -> bool:
        checked, names, data = check_conditional_write(conditions, keys, values)
        with self._shared.cond:
            written, changed = self._shared.state.multi_set_if(checked, names, data)
            self._mutate(changed)
            return written

    def append(self, key: str, value: Value) -> None:
        data = to_bytes(value)
        with self._shared.cond:
            self._mutate(self._shared.state.append(check_key(key), data))

    def delete_key(self, key: str) -> bool:
        with self._shared.cond:
            changed = self._shared.state.delete(check_key(key))
            self._mutate(changed)
            return bool(changed)

    # -- reads ------------------------------------------------------------------------------
    def try_get(self, key: str) -> bytes | None:
        with self._shared.cond:
            return self._shared.state.get(check_key(key))

    def check(self, keys: Sequence[str]) -> bool:
        with self._shared.cond:
            return all(self._shared.state.contains(check_key(k)) for k in keys)

    def num_keys(self) -> int:
        with self._shared.cond:
            return self._shared.state.num_keys()

    def list_keys(self, prefix: str) -> dict[str, bytes]:
        with self._shared.cond:
            return self._shared.state.list_keys(prefix)

    def count_keys(self, prefix: str) -> int:
        with self._shared.cond:
            return self._shared.state.count_keys(prefix)

    def revision(self, path: str = "") -> int:
        with self._shared.cond:
            return self._shared.state.path_revision(path)

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        deadline = time.monotonic() + to_seconds(timeout, self._timeout)
        state, cond = self._shared.state, self._shared.cond
        with cond:
            while True:
                current = state.path_revision(path)
                remaining = deadline - time.monotonic()
                if current > since or remaining <= 0:
                    return current
                cond.wait(remaining)

    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        deadline = time.monotonic() + timeout
        state, cond = self._shared.state, self._shared.cond
        with cond:
            while True:
                values = [state.get(k) for k in keys]
                if all(v is not None for v in values):
                    return values  # type: ignore[return-value]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError.waiting_for([k for k, v in zip(keys, values) if v is None], timeout)
                cond.wait(remaining)

    # -- sessions ---------------------------------------------------------------------------
    def _owner(self, ephemeral: bool) -> int:
        return self._session if ephemeral else 0

    def close(self) -> None:
        """Delete this handle's ephemeral keys; the data stays for the other handles."""
        with self._shared.cond:
            if not self._closed:
                self._closed = True
                self._mutate(self._shared.state.close_session(self._session))
