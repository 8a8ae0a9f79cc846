"""A small etcd v3 client over etcd's JSON gateway (``POST /v3/...``), stdlib only.

It sends one request at a time per pooled HTTP connection, fails over between the cluster's
endpoints while a member is down or leaderless, authenticates with user/password (renewing the
token when etcd expires it), speaks https with client certificates, and runs watches as
streaming requests. etcd's errors become rdzv's typed store errors naming the endpoint.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import ssl
import threading
import time
from typing import Any

from .._patience import Patience
from ..errors import (
    SessionExpiredError,
    StoreAuthenticationError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreValueError,
)
from ._http import HTTPConnection
from ._options import EtcdOptions

logger = logging.getLogger(__name__)

WATCH_CHUNK = 5.0
"""Seconds a watch stream stays open before it is re-created from the same revision.

Bounds how long a watcher can sit on a member that silently stopped answering."""

MAX_TXN_OPS = 128
"""etcd's default limit of operations in one transaction (``--max-txn-ops``)."""

_IDLE_PER_ENDPOINT = 8
# gRPC status codes that etcd returns through the gateway.
_INVALID_ARGUMENT, _DEADLINE, _NOT_FOUND, _PERMISSION, _EXHAUSTED = 3, 4, 5, 7, 8
_OUT_OF_RANGE, _UNAVAILABLE, _UNAUTHENTICATED = 11, 14, 16


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` that selects every key starting with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"  # every key
    return stripped[:-1] + bytes([stripped[-1] + 1])


class EtcdCompactedError(StoreError):
    """A watch asked for history that etcd has compacted away."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class EtcdAmbiguousError(StoreConnectionError):
    """A request was sent but its answer was lost: it may or may not have been applied."""


class _Transient(Exception):
    """An endpoint failed in a way that another endpoint (or a later try) may not."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class EtcdClient:
    """Requests to an etcd cluster with fail-over; safe to share between threads."""

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._ssl = options.ssl_context()
        self._lock = threading.Lock()
        self._current = 0
        self._idle: dict[str, list[HTTPConnection]] = {}
        self._token: str | None = None
        self._closed = False
        self._pid = os.getpid()

    # -- endpoints and connections ------------------------------------------------------------
    @property
    def _endpoints(self) -> str:
        return ", ".join(self.options.endpoints)

    @property
    def endpoint(self) -> str:
        """The endpoint requests go to now."""
        return self.options.endpoints[self._current % len(self.options.endpoints)]

    def _fail_over(self, endpoint: str, reason: str) -> None:
        """Move on from ``endpoint`` (unless another thread did) and drop its idle connections."""
        with self._lock:
            stale = self._idle.pop(endpoint, [])
            if self.endpoint == endpoint:
                self._current += 1
                logger.debug("etcd %s failed (%s); trying %s", endpoint, reason, self.endpoint)
        for conn in stale:
            conn.close()

    def _connect(self, endpoint: str, timeout: float) -> HTTPConnection:
        if self._closed:
            raise StoreConnectionError("the etcd client is closed")
        try:
            return HTTPConnection(endpoint, timeout, self._ssl)
        except ssl.SSLError as exc:
            raise StoreConnectionError(f"TLS with etcd at {endpoint} failed: {exc}") from exc
        except OSError as exc:
            raise _Transient(f"cannot connect: {exc}", sent=False) from exc

    def _take(self, endpoint: str) -> HTTPConnection:
        with self._lock:
            if self._pid != os.getpid():  # forked: the pooled sockets belong to the parent
                self._pid = os.getpid()
                self._idle.clear()
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
        return self._connect(endpoint, self.options.request_timeout)

    def _give(self, endpoint: str, conn: HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if conn.reusable and not self._closed and len(idle) < _IDLE_PER_ENDPOINT:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close every pooled connection; later requests raise StoreConnectionError."""
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()

    # -- requests -----------------------------------------------------------------------------
    def call(
        self, path: str, body: dict[str, Any], *, retry_ambiguous: bool = True
    ) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` and return the decoded answer, failing over as needed.

        A request whose answer was lost is re-sent only if ``retry_ambiguous`` (it is
        idempotent); otherwise :class:`EtcdAmbiguousError` lets the caller check what happened.
        """
        deadline = time.monotonic() + self.options.retry_timeout
        failures: dict[str, str] = {}
        attempt = 0
        patience = Patience(logger, f"no etcd endpoint answers yet ({self._endpoints})", deadline)
        while True:
            endpoint = self.endpoint
            try:
                return self._request(endpoint, path, body)
            except _Transient as exc:
                failures[endpoint] = str(exc)
                self._fail_over(endpoint, str(exc))
                patience.failed(f"{endpoint}: {exc}")
                if exc.sent and not retry_ambiguous:
                    raise EtcdAmbiguousError(
                        f"etcd at {endpoint} lost the answer to {path} ({exc}); "
                        "it may have been applied"
                    ) from exc
            attempt += 1
            if time.monotonic() > deadline:
                shown = "; ".join(f"{ep}: {why}" for ep, why in failures.items())
                hint = ""
                if self.options.protocol == "http" and (
                    "closed the connection" in shown or "reset" in shown
                ):
                    hint = " (if etcd serves https, set protocol=https)"
                raise StoreConnectionError(
                    f"no etcd endpoint answered {path} within {self.options.retry_timeout:g} s "
                    f"({shown}); check that etcd runs at {', '.join(self.options.endpoints)}{hint}"
                )
            if attempt % len(self.options.endpoints) == 0:
                time.sleep(min(1.0, 0.05 * 2 ** (attempt // len(self.options.endpoints))))

    def _headers(self, endpoint: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.options.user is not None:
            token = self._token or self._authenticate(endpoint)
            headers["Authorization"] = token
        return headers

    def _authenticate(self, endpoint: str) -> str:
        answer = self._send(
            endpoint,
            "auth/authenticate",
            {"name": self.options.user, "password": self.options.password},
            {"Content-Type": "application/json"},
        )
        token = answer.get("token")
        if not token:
            raise StoreAuthenticationError(
                f"etcd at {endpoint} gave no token for user {self.options.user!r}: is auth enabled?"
            )
        self._token = token
        return token

    def _request(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._send(endpoint, path, body, self._headers(endpoint))
        except _InvalidToken:
            self._token = None
            return self._send(endpoint, path, body, self._headers(endpoint))

    def _send(
        self, endpoint: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        conn = self._take(endpoint)
        try:
            status, raw = conn.post(f"/v3/{path}", json.dumps(body).encode(), headers)
        except ssl.SSLError as exc:
            conn.close()
            raise StoreConnectionError(f"TLS with etcd at {endpoint} failed: {exc}") from exc
        except OSError as exc:
            conn.close()
            raise _Transient(f"{type(exc).__name__}: {exc}", sent=True) from exc
        self._give(endpoint, conn)
        answer = _decode(endpoint, path, status, raw)
        if status != 200:
            _raise_error(endpoint, path, answer)
        return answer

    # -- watches ------------------------------------------------------------------------------
    def watch(self, *creates: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        """The events of the first watch response for any of ``creates`` (WatchCreateRequests,
        all on one stream), or [] if none came within ``timeout`` seconds. Raises
        EtcdCompactedError if a ``start_revision`` was compacted."""
        deadline = time.monotonic() + timeout
        failing_since: float | None = None
        patience: Patience | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            endpoint = self.endpoint
            try:
                events = self._watch_stream(endpoint, creates, min(remaining, WATCH_CHUNK))
                failing_since = None
                if events:
                    return events
            except _Transient as exc:
                self._fail_over(endpoint, str(exc))
                now = time.monotonic()
                failing_since = failing_since or now
                patience = patience or Patience(
                    logger, f"no etcd endpoint would watch ({self._endpoints})",
                    failing_since + self.options.retry_timeout)
                patience.failed(f"{endpoint}: {exc}")
                if now - failing_since > self.options.retry_timeout:
                    raise StoreConnectionError(
                        f"no etcd endpoint would watch for {self.options.retry_timeout:g} s "
                        f"(last: {endpoint}: {exc})"
                    ) from exc
                time.sleep(min(0.2, max(0.0, deadline - now)))

    def history(self, start: int, end: int) -> list[dict[str, Any]]:
        """Every event of the whole keyspace with ``start <= revision <= end``.

        ``end`` must be a revision etcd has reached: as every revision but the first is one change
        of some key, the stream then surely carries an event at ``end``, which marks the end of
        history. Revision 1 is etcd's empty start: no event has it (a fresh cluster's history is
        empty, not a wait for an event that never comes).
        """
        events: list[dict[str, Any]] = []
        everything = b64(b"\0")
        start = max(start, 2)
        while start <= end:
            create = {"key": everything, "range_end": everything, "start_revision": start}
            batch = self.watch(create, timeout=self.options.retry_timeout)
            if not batch:
                raise StoreConnectionError(
                    f"etcd at {self.endpoint} sent no history from revision {start} "
                    f"within {self.options.retry_timeout:g} s"
                )
            events += [e for e in batch if int(e["kv"]["mod_revision"]) <= end]
            start = max(int(e["kv"]["mod_revision"]) for e in batch) + 1
        return events

    def _watch_stream(
        self, endpoint: str, creates: tuple[dict[str, Any], ...], seconds: float
    ) -> list[dict[str, Any]]:
        conn = self._connect(endpoint, self.options.request_timeout)
        try:
            try:
                # hasleader: a member cut off from the leader ends the watch instead of idling
                headers = {**self._headers(endpoint), "Grpc-Metadata-hasleader": "true"}
                body = "\n".join(json.dumps({"create_request": c}) for c in creates).encode()
                status, head = conn.send("/v3/watch", body, headers)
                if status != 200:
                    raw = conn.read_body(head)
                    _raise_error(endpoint, "watch", _decode(endpoint, "watch", status, raw))
                conn.begin_stream(head)
                ends = time.monotonic() + seconds
                created = False
                while True:
                    wait = self.options.request_timeout if not created else ends - time.monotonic()
                    if wait <= 0:
                        return []
                    try:
                        line = conn.next_line(wait)
                    except socket.timeout:
                        if created:
                            return []
                        raise _Transient("watch was not created in time", sent=True) from None
                    if not line:
                        raise _Transient("watch stream closed by the server", sent=True)
                    message = _decode(endpoint, "watch", 200, line)
                    if "error" in message:
                        _raise_error(endpoint, "watch", message)
                    result = message.get("result", {})
                    created = created or bool(result.get("created"))
                    if result.get("compact_revision") and result.get("canceled"):
                        raise EtcdCompactedError(
                            f"etcd at {endpoint} compacted revisions up to "
                            f"{result['compact_revision']}",
                            int(result["compact_revision"]),
                        )
                    if result.get("canceled") and "permission denied" in str(
                        result.get("cancel_reason")
                    ):
                        raise StoreAuthenticationError(
                            f"etcd at {endpoint} denied a watch: "
                            "grant this etcd user read on the keys"
                        )
                    if result.get("canceled"):
                        raise StoreError(
                            f"etcd at {endpoint} canceled a watch: {result.get('cancel_reason')}"
                        )
                    if result.get("events"):
                        return result["events"]
            except _InvalidToken:
                self._token = None
                raise _Transient("auth token expired", sent=False) from None
            except StoreError:  # rdzv's connection errors are OSErrors too: not transient here
                raise
            except ssl.SSLError as exc:
                raise StoreConnectionError(f"TLS with etcd at {endpoint} failed: {exc}") from exc
            except OSError as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}", sent=True) from exc
        finally:
            conn.close()


class _InvalidToken(Exception):
    """etcd rejected the auth token (it expires): authenticate again."""


def _decode(endpoint: str, path: str, status: int, raw: bytes) -> dict[str, Any]:
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        hint = ""
        if b"HTTPS" in raw:
            hint = " (the server speaks https: set protocol=https)"
        elif status == 404:
            hint = " (etcd >= 3.4 with its v3 JSON gateway is required)"
        raise StoreProtocolError(
            f"etcd at {endpoint} answered {path} with HTTP {status} and no JSON{hint}: "
            f"{raw[:120]!r}"
        )
    return answer


def _raise_error(endpoint: str, path: str, answer: dict[str, Any]) -> None:
    """Raise the rdzv error for an etcd error answer ``{"code": ..., "message": ...}``."""
    if isinstance(answer.get("error"), dict):  # a stream's error: {"error": {"grpc_code": ...}}
        answer = answer["error"]
    code = int(answer.get("code", answer.get("grpc_code", 2)))
    message = str(answer.get("message") or answer.get("error") or answer)
    where = f"etcd at {endpoint} rejected {path}: {message}"
    if code == _UNAUTHENTICATED and "token" in message:
        raise _InvalidToken(message)
    if code in (_UNAVAILABLE, _DEADLINE) or (code == _EXHAUSTED and "too many" in message):
        raise _Transient(message, sent=True)
    if (
        "authentication failed" in message
        or code == _UNAUTHENTICATED
        or "user name is empty" in message
    ):
        raise StoreAuthenticationError(
            f"{where} (pass the right user and password; etcd has authentication enabled)"
        )
    if code == _PERMISSION:
        raise StoreAuthenticationError(
            f"{where} (grant this etcd user read/write on the key prefix)"
        )
    if code == _NOT_FOUND and "lease" in message:
        raise SessionExpiredError(f"{where}: this client's session expired")
    if code == _OUT_OF_RANGE and "compacted" in message:
        raise EtcdCompactedError(where, 0)
    if code == _INVALID_ARGUMENT:
        raise StoreValueError(where)
    raise StoreError(where)
