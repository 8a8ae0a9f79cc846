"""The TCPStore's blocking reads: waits on the server in slices no longer than ttl/3.

Functions over a :class:`~rdzv.store._tcp_conn.StoreConnection`, for the blocking ``get``,
``multi_get``, ``wait``, ``watch`` and ``watch_get`` of :class:`~rdzv.store.TCPStore`: each waits
on the server in slices of at most ``session_ttl / 3`` (the connection's ``ping_every``), so that
a waiting client never looks dead to the server, until what it waits for happens or its timeout
runs out.
"""

from __future__ import annotations

import time
from typing import Callable

from ..errors import StoreTimeoutError
from ..kv import protocol as P
from ._base import Timeout, to_seconds
from ._tcp_conn import StoreConnection

_OK = P.STATUS_OK
_TIMEOUT = P.STATUS_TIMEOUT
_monotonic = time.monotonic

SliceEncoder = Callable[[int, int], bytes]
"""``encode(rid, wait_ms)``: the request of one slice, a server-side wait of ``wait_ms``."""


def get(conn: StoreConnection, key: str, timeout: float, deadline: float | None = None) -> bytes:
    """The value of ``key`` once it is set, waiting until ``deadline`` (default: ``timeout``
    seconds from now); StoreTimeoutError after that."""
    kb = key.encode()
    if deadline is None:
        deadline = _monotonic() + timeout
    while True:
        done, payload = _slice(
            conn, lambda rid, wait: P.encode_get(rid, kb, True, wait), deadline, "get", key
        )
        if done:
            return payload
        if _monotonic() >= deadline:
            raise StoreTimeoutError.waiting_for([key], timeout)


def multi_get(conn: StoreConnection, keys: list[str], timeout: float) -> list[bytes]:
    """The values of ``keys`` once all are set; StoreTimeoutError after ``timeout`` seconds."""
    if len(keys) == 1:
        return [get(conn, keys[0], timeout)]
    if not keys:
        return []
    return P.decode_values(_wait_keys(conn, P.encode_multi_get, keys, timeout, "multi_get"))


def wait(conn: StoreConnection, keys: list[str], timeout: float) -> None:
    """Return once every key of ``keys`` is set; StoreTimeoutError after ``timeout`` seconds."""
    if keys:
        _wait_keys(conn, P.encode_wait, keys, timeout, "wait")


def watch(
    conn: StoreConnection, encode: SliceEncoder, what: str, path: str, since: int, timeout: Timeout
) -> bytes:
    """The answer to a watch (or watch_get) of ``path``, sent in slices until the path changes
    after ``since`` or ``timeout`` (default: the connection's) runs out."""
    deadline = _monotonic() + to_seconds(timeout, conn.timeout)
    while True:
        _, payload = _slice(conn, encode, deadline, what, path)  # (a watch never times out)
        if P.decode_u64(payload[:8]) > since or _monotonic() >= deadline:
            return payload


def _wait_keys(
    conn: StoreConnection,
    encode: Callable[[int, list[bytes], int], bytes],
    keys: list[str],
    timeout: float,
    what: str,
) -> bytes:
    kbs = [k.encode() for k in keys]
    deadline = _monotonic() + timeout
    while True:
        done, payload = _slice(
            conn, lambda rid, wait: encode(rid, kbs, wait), deadline, what, keys[0]
        )
        if done:
            return payload
        if _monotonic() >= deadline:
            raise StoreTimeoutError.waiting_for(P.decode_keys(payload) or keys, timeout)


def _slice(
    conn: StoreConnection, encode: SliceEncoder, deadline: float, what: str, key: str
) -> tuple[bool, bytes]:
    """One server-side wait of at most ttl/3: (True, OK payload) or (False, TIMEOUT payload)."""
    remaining = deadline - _monotonic()
    wait_ms = P.wait_ms(min(remaining, conn.ping_every)) if remaining > 0 else 0
    status, payload = conn.request(encode, (wait_ms,), deadline)
    if status == _OK:
        return True, payload
    if status == _TIMEOUT:
        return False, payload
    raise conn.error(status, payload, what, key)
