"""The TCPStore's blocking calls: watches and waits, sent as server-side waits in chunks.

A part of :class:`~rdzv.store.TCPStore`: each blocking call waits on the server in chunks of at
most ``session_ttl / 3`` (so that a waiting client never looks dead to the server) until what it
waits for happens or its timeout runs out.
"""

from __future__ import annotations

import time
from typing import Callable

from ..errors import StoreProtocolError, StoreTimeoutError
from ..kv import protocol as P
from ._base import Store, Timeout, check_key, to_seconds
from ._tcp_conn import StoreConnection, log

_OK = P.STATUS_OK
_TIMEOUT = P.STATUS_TIMEOUT
_encode_get = P.encode_get
_monotonic = time.monotonic


class BlockingCalls(StoreConnection, Store):
    """``watch``, ``watch_get``, blocking ``get``, ``multi_get`` and ``wait`` of a TCPStore."""

    def get(self, key: str) -> bytes:
        if key.__class__ is not str or not key:
            check_key(key)
        timeout = self._timeout
        if timeout < self._ping_every:
            return self._get1(key, timeout)
        # Fast path: the first (often the only) server-side wait is a whole chunk.
        started = _monotonic()
        with self._lock:
            rid = self._rid = self._rid + 1
            status, payload = self._request(
                _encode_get(rid, key.encode(), True, self._chunk_ms), rid, started + timeout
            )
        if status == _OK:
            return payload
        if status != _TIMEOUT:
            raise self._error(status, payload, "get", key)
        if _monotonic() >= started + timeout:
            raise StoreTimeoutError.waiting_for([key], timeout)
        return self._get1(key, timeout, started + timeout)

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        pb, since = path.encode(), int(since)
        encode = lambda rid, wait: P.encode_watch(rid, pb, since, wait)  # noqa: E731
        return P.decode_u64(self._watch(encode, "watch", path, since, timeout))

    def watch_get(
        self, path: str, since: int, key: str, timeout: Timeout = None
    ) -> tuple[int, bytes | None]:
        if self._server_lacks_watch_get:
            return super().watch_get(path, since, key, timeout)
        pb, kb, since = path.encode(), check_key(key).encode(), int(since)
        encode = lambda rid, wait: P.encode_watch_get(rid, pb, since, wait, kb)  # noqa: E731
        try:
            return P.decode_watch_get(self._watch(encode, "watch_get", path, since, timeout))
        except StoreProtocolError as exc:
            if exc.code != P.E_UNKNOWN_OP:
                raise
        log.info("the store server at %s:%d predates watch_get: watch, then get", self._host,
                 self._port)
        self._server_lacks_watch_get = True
        return super().watch_get(path, since, key, timeout)

    def _watch(
        self, encode: Callable[[int, int], bytes], what: str, path: str, since: int,
        timeout: Timeout,
    ) -> bytes:
        """The answer to a watch (or watch_get) of ``path``, sent in server-side waits of at
        most ttl/3 until the path changes after ``since`` or ``timeout`` runs out."""
        deadline = _monotonic() + to_seconds(timeout, self._timeout)
        while True:
            _, payload = self._chunk(encode, deadline, what, path)  # (a watch never times out)
            if P.decode_u64(payload[:8]) > since or _monotonic() >= deadline:
                return payload

    def _get1(self, key: str, timeout: float, deadline: float | None = None) -> bytes:
        kb = key.encode()
        if deadline is None:
            deadline = _monotonic() + timeout
        while True:
            done, payload = self._chunk(
                lambda rid, wait: P.encode_get(rid, kb, True, wait), deadline, "get", key
            )
            if done:
                return payload
            if _monotonic() >= deadline:
                raise StoreTimeoutError.waiting_for([key], timeout)

    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        if len(keys) == 1:
            return [self._get1(keys[0], timeout)]
        if not keys:
            return []
        return P.decode_values(self._wait_keys(P.encode_multi_get, keys, timeout, "multi_get"))

    def _wait(self, keys: list[str], timeout: float) -> None:
        if keys:
            self._wait_keys(P.encode_wait, keys, timeout, "wait")

    def _wait_keys(
        self, encode: Callable[[int, list[bytes], int], bytes], keys: list[str], timeout: float, what: str
    ) -> bytes:
        kbs = [k.encode() for k in keys]
        deadline = _monotonic() + timeout
        while True:
            done, payload = self._chunk(lambda rid, wait: encode(rid, kbs, wait), deadline, what, keys[0])
            if done:
                return payload
            if _monotonic() >= deadline:
                raise StoreTimeoutError.waiting_for(P.decode_keys(payload) or keys, timeout)

    def _chunk(
        self, encode: Callable[[int, int], bytes], deadline: float, what: str, key: str
    ) -> tuple[bool, bytes]:
        """One server-side wait of at most ttl/3: (True, OK payload) or (False, TIMEOUT payload)."""
        remaining = deadline - _monotonic()
        wait = P.wait_ms(min(remaining, self._ping_every)) if remaining > 0 else 0
        with self._lock:
            rid = self._rid = self._rid + 1
            status, payload = self._request(encode(rid, wait), rid, deadline)
        if status == _OK:
            return True, payload
        if status == _TIMEOUT:
            return False, payload
        raise self._error(status, payload, what, key)
