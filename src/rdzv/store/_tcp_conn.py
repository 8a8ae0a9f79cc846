"""The TCPStore's connection: requests and answers, pipelining, reconnects, keepalive.

:class:`StoreConnection` is the half of :class:`~rdzv.store.TCPStore` that talks to the server:
one blocking socket (``TCP_NODELAY``) under one lock. It sends a request and reads its answer,
sends the void writes without waiting (*pipelined*: their answers, or for quiet SETs the answer
to any later request, confirm them in order), re-establishes a lost connection within the call's
timeout (resuming the session and resending every unconfirmed write, in order; after a session
expired, only what is safe to apply again: :meth:`StoreConnection._drop_unresendable`), and maps the
server's errors to the rdzv error types. Its keepalive pings an idle connection (called every
``session_ttl / 3`` seconds by the one keepalive thread of the process). The handshake of each
new connection is :mod:`._tcp_handshake`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from typing import Callable

from .._patience import Patience
from ..errors import (
    SessionExpiredError,
    StoreAuthenticationError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreValueError,
)
from ..kv import auth, protocol as P
from ._tcp_handshake import HANDSHAKE_TIMEOUT, ClientHandshake, _ConnectionLost

log = logging.getLogger("rdzv.store.tcp")

_MAX_BACKOFF = 1.0
MAX_UNACKED_WRITES = 256
"""Pipelined writes a client may have unacknowledged before a write waits for their answers."""
MAX_UNACKED_BYTES = 4 << 20
"""... and their total size in bytes (the client keeps them to resend after a reconnect)."""
_RESP_unpack_from = P.RESP_HEAD.unpack_from
_OK = P.STATUS_OK
_monotonic = time.monotonic


def _describe(exc: BaseException | None, reply_timeout: float | None = None) -> str:
    if exc is None:
        return "not connected"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (BlockingIOError, socket.timeout)):
        return f"no reply within {reply_timeout:g} s" if reply_timeout else "timed out"
    if isinstance(exc, socket.gaierror):
        return (f"cannot resolve the host name ({exc.strerror}; a well-formed name is retried "
                "until the timeout, as a new pod's DNS name can take a while to appear)")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__



class StoreConnection(ClientHandshake):
    """The connection half of :class:`~rdzv.store.TCPStore` (see the module docstring)."""

    _timeout: float
    """The store's timeout in seconds (set by :class:`~rdzv.store.Store`)."""

    def _init_connection(
        self, host_name: str, port: int, secret: auth.Secret, session_ttl: float
    ) -> None:
        """Set up (not yet open) the connection to ``host_name:port``."""
        self._host = host_name
        self._port = int(port)
        self._secret = auth.normalize_secret(secret) if secret is not None else auth.secret_from_env()
        self._ttl = session_ttl
        self._ping_every = session_ttl / 3.0 if session_ttl > 0 else 60.0
        # How long to wait for any answer before taking the server for dead (and reconnecting):
        # longer than the longest server-side wait (one chunk), and fixed, so that the socket
        # option is set once per connection.
        self._reply_timeout = max(2.0 * self._ping_every + 1.0, 5.0)
        self._chunk_ms = P.wait_ms(self._ping_every)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._stale: socket.socket | None = None
        self._rbuf = b""
        self._rid = 0
        self._session = 0
        self._token = b""
        """The resume token of the session (the proof that it is this client's)."""
        self._had_ephemeral = False
        self._max_frame = P.DEFAULT_MAX_FRAME_SIZE
        self._closed = False
        self._pending_error: BaseException | None = None
        self._unacked: deque[tuple[int, bytes, str, str | None]] = deque()
        """Pipelined writes sent but not yet acknowledged: (request id, frame, op name, key)."""
        self._unacked_bytes = 0
        self._write_error: StoreError | None = None
        self._last_send = _monotonic()
        self._held: list[bytes] = []
        """Pipelined writes made inside :meth:`TCPStore.batch`, not sent yet: they go out with
        the next request (one message instead of several), at the latest when the block ends."""
        self._batch_owner: int | None = None
        """The thread in a :meth:`TCPStore.batch` block (only its writes are held)."""
        self._batch_depth = 0
        self._server_lacks_watch_get = False

    def _simple(self, encode: Callable[[int], bytes], what: str, key: str | None = None) -> bytes:
        with self._lock:
            rid = self._rid = self._rid + 1
            status, payload = self._request(encode(rid), rid)
        if status:
            raise self._error(status, payload, what, key)
        return payload

    def _send_write(self, frame: bytes, rid: int, what: str, key: str | None) -> None:
        """Send a void write without waiting for its answer (pipelined). Lock held.

        The write is kept until acknowledged (to be resent after a reconnect); with too many
        unacknowledged, or no connection, this waits for the answers (reconnecting if needed).
        """
        if self._pending_error is not None:
            exc, self._pending_error = self._pending_error, None
            raise exc
        size = len(frame)
        if size > self._max_frame + 4:
            self._check_frame_size(frame)
        unacked = self._unacked
        unacked.append((rid, frame, what, key))
        self._unacked_bytes += size
        sock = self._sock
        if sock is not None:
            if (
                self._batch_owner == threading.get_ident()
                and len(unacked) <= MAX_UNACKED_WRITES
                and self._unacked_bytes <= MAX_UNACKED_BYTES
            ):
                self._held.append(frame)  # (already in unacked: resent if the connection drops)
                return
            try:  # (not counted as a sign of life: the keepalive may ping a busy writer)
                sock.sendall(self._with_held(frame))
            except OSError as exc:
                log.debug("connection to %s:%d lost: %s", self._host, self._port, exc)
                self._disconnect(exc)
            else:
                if len(unacked) <= MAX_UNACKED_WRITES and self._unacked_bytes <= MAX_UNACKED_BYTES:
                    return
        ping = self._rid = self._rid + 1
        self._request(P.encode_ping(ping), ping)

    def _with_held(self, frame: bytes) -> bytes:
        """``frame`` after the held writes, which are then no longer held."""
        if not self._held:
            return frame
        self._held.append(frame)
        data = b"".join(self._held)
        self._held.clear()
        return data

    def _send_held(self) -> None:
        """Send the held writes now (the end of a batch). Lock held."""
        sock = self._sock
        if self._held and sock is not None:
            try:
                sock.sendall(self._with_held(b""))
            except OSError as exc:  # they are resent, in order, by the next call's reconnect
                log.debug("connection to %s:%d lost: %s", self._host, self._port, exc)
                self._disconnect(exc)

    def _drop_unresendable(self) -> list[str]:
        """The session expired: forget the unacknowledged writes that must not be sent again
        in the new session (see :data:`~rdzv.kv.protocol.RESENDABLE_AFTER_EXPIRY`);
        returns them, named (``set('key')``), for the error that reports them."""
        kept: deque[tuple[int, bytes, str, str | None]] = deque()
        dropped = []
        for unacked in self._unacked:
            if P.resendable_after_expiry(unacked[1]):
                kept.append(unacked)
            else:
                dropped.append(f"{unacked[2]}({unacked[3]!r})")
        self._unacked_bytes = sum(len(u[1]) for u in kept)
        self._unacked = kept
        return dropped

    def _check_frame_size(self, frame: bytes) -> None:
        if len(frame) > self._max_frame + 4:
            raise StoreValueError(
                f"request of {len(frame) - 4} bytes exceeds the server's maximum frame size of "
                f"{self._max_frame} bytes"
            )

    def _acknowledged(self, status: int, payload: bytes) -> None:
        """The answer to the oldest pipelined write arrived; keep its error for the next call."""
        _, frame, what, key = self._unacked.popleft()
        self._unacked_bytes -= len(frame)
        if status != _OK and self._write_error is None:
            err = self._error(status, payload, what, key)
            self._write_error = type(err)(
                f"{what}({key!r}), sent earlier by this client, failed: {err} (reported by the "
                "next call to the server, which was itself carried out)"
            )

    def _request(
        self, frame: bytes, rid: int, deadline: float | None = None, *, report: bool = True
    ) -> tuple[int, bytes]:
        """Send ``frame`` and return (status, payload) of its response. Lock held.

        A lost connection is re-established until ``deadline`` (default: the store timeout from
        now), and the unacknowledged writes and this request are resent, in order; the server
        applies none of them twice. Raises the error of an earlier pipelined write that the
        answers read on the way report (unless ``report`` is false: it waits for the next call).
        """
        sock = self._sock
        if sock is None or self._pending_error is not None or len(frame) > self._max_frame + 4:
            result = self._request_slow(frame, rid, deadline, None)
        else:
            try:
                self._last_send = _monotonic()
                sock.sendall(self._with_held(frame) if self._held else frame)
                result = self._read_response(sock, rid)
            except StoreError:
                self._disconnect()
                raise
            except OSError as exc:
                log.debug("connection to %s:%d lost: %s", self._host, self._port, exc)
                self._disconnect(exc)
                result = self._request_slow(frame, rid, deadline, exc)
        if report and self._write_error is not None:
            err, self._write_error = self._write_error, None
            raise err
        return result

    def _exchange_many(self, frames: list[bytes], first_rid: int) -> list[tuple[int, bytes]]:
        """Send the read-only requests ``frames`` (ids ``first_rid``, ``first_rid + 1``...) in
        one write, then read their answers: one round trip. Lock held.

        Reads are idempotent: if the connection is lost, the ones not yet answered are sent
        again, one by one, over the new connection.
        """
        for frame in frames:
            self._check_frame_size(frame)
        answers: list[tuple[int, bytes]] = []
        sock = self._sock
        if sock is not None and self._pending_error is None:
            try:
                self._last_send = _monotonic()
                sock.sendall(self._with_held(b"".join(frames)))
                for i in range(len(frames)):
                    answers.append(self._read_response(sock, first_rid + i))
            except StoreError:
                self._disconnect()
                raise
            except OSError as exc:
                log.debug("connection to %s:%d lost: %s", self._host, self._port, exc)
                self._disconnect(exc)
        deadline = _monotonic() + self._timeout
        for i in range(len(answers), len(frames)):
            answers.append(self._request_slow(frames[i], first_rid + i, deadline, None))
        if self._write_error is not None:
            err, self._write_error = self._write_error, None
            raise err
        return answers

    def _request_slow(
        self, frame: bytes, rid: int, deadline: float | None, reason: BaseException | None
    ) -> tuple[int, bytes]:
        if self._pending_error is not None:
            exc, self._pending_error = self._pending_error, None
            raise exc
        self._check_frame_size(frame)
        attempts = 1 if reason is not None else 0
        sent_in = self._session if reason is not None else None  # the session it may have reached
        while True:
            sock = self._sock
            if sock is None:
                if self._closed:
                    raise StoreError(f"this TCPStore ({self._host}:{self._port}) is closed")
                if deadline is None:
                    deadline = _monotonic() + self._timeout
                if attempts and _monotonic() >= deadline:
                    raise StoreConnectionError(
                        f"lost the connection to the store server at {self._host}:{self._port} "
                        f"({_describe(reason, self._reply_timeout)})"
                    ) from reason
                self._connect(deadline, reason)
                sock = self._sock
                assert sock is not None
                if sent_in not in (None, self._session) and not P.resendable_after_expiry(frame):
                    raise SessionExpiredError(
                        f"the session {sent_in} of this client at the store server "
                        f"{self._host}:{self._port} expired while its {P.OP_NAMES[frame[4]]} "
                        "request was unanswered: it may or may not have been applied, and is "
                        f"not sent again in the new session {self._session}"
                    )
            attempts += 1
            sent_in = self._session
            try:
                self._last_send = _monotonic()
                sock.sendall(self._with_held(frame))
                return self._read_response(sock, rid)
            except StoreError:
                self._disconnect()
                raise
            except OSError as exc:
                reason = exc
                log.debug("connection to %s:%d lost: %s", self._host, self._port, exc)
                self._disconnect(exc)

    def _read_response(self, sock: socket.socket, rid: int) -> tuple[int, bytes]:
        buf = self._rbuf or sock.recv(65536)  # usually nothing is left over: read at once
        while True:
            size = len(buf)
            if size >= 9:
                length, status, r = _RESP_unpack_from(buf)
                end = length + 4
                if size >= end:
                    if size == end:
                        payload = buf[9:]
                        buf = b""
                    else:
                        payload = buf[9:end]
                        buf = buf[end:]
                    unacked = self._unacked
                    if unacked:
                        # Answers come in request order: one to request r implies that every
                        # write sent before it succeeded (quiet SETs are answered only on error).
                        if unacked[-1][0] < r:
                            unacked.clear()
                            self._unacked_bytes = 0
                        while unacked and unacked[0][0] < r:
                            self._acknowledged(_OK, b"")
                        if unacked and unacked[0][0] == r:
                            self._acknowledged(status, payload)
                            continue
                    if r == rid:
                        self._rbuf = buf
                        return status, payload
                    if r == 0 and status == P.STATUS_ERROR:
                        code, msg = P.decode_error(payload)
                        raise StoreProtocolError(
                            f"the store server at {self._host}:{self._port} closed the "
                            f"connection: {msg}"
                        )
                    continue  # the answer to a request given up on earlier
                if length < P.HEAD_SIZE or length > self._max_frame + (1 << 20):
                    raise StoreProtocolError(
                        f"malformed response frame ({length} bytes) from the store server at "
                        f"{self._host}:{self._port}"
                    )
                if end > 1 << 20:
                    buf = self._recv_exactly(sock, buf, end)
                    continue
            chunk = sock.recv(65536)
            if not chunk:
                raise _ConnectionLost("the server closed the connection")
            buf = buf + chunk if buf else chunk

    @staticmethod
    def _recv_exactly(sock: socket.socket, head: bytes, size: int) -> bytes:
        data = bytearray(size)
        view = memoryview(data)
        have = len(head)
        view[:have] = head
        while have < size:
            n = sock.recv_into(view[have:])
            if n == 0:
                raise _ConnectionLost("the server closed the connection")
            have += n
        return bytes(data)

    def _disconnect(self, why: BaseException | None = None) -> None:
        sock = self._sock
        self._sock = None
        self._rbuf = b""
        self._held.clear()  # (every held write is in _unacked: the reconnect resends it)
        if sock is None:
            return
        if isinstance(why, (BlockingIOError, socket.timeout)) and self._stale is None:
            # The server did not answer in time but may be alive: closing this socket now would
            # end the session there. Keep it until a new connection has resumed the session.
            self._stale = sock
            return
        try:
            sock.close()
        except OSError:  # pragma: no cover
            pass

    def _connect(self, deadline: float, lost: BaseException | None) -> None:
        """Connect and handshake, retrying until ``deadline`` (a server may not be up yet)."""
        delay = 0.01
        last: BaseException | None = None
        addr = f"{self._host}:{self._port}"
        patience = Patience(log, f"cannot reach the store server at {addr} yet", deadline,
                            clock=_monotonic)
        while True:
            remaining = deadline - _monotonic()
            try:
                sock = socket.create_connection(
                    (self._host, self._port), timeout=max(0.05, min(remaining, HANDSHAKE_TIMEOUT))
                )
            except OSError as exc:
                last = exc
                patience.failed(_describe(exc))
            else:
                try:
                    self._handshake(sock, deadline)
                    return
                except SessionExpiredError:
                    raise  # connected, in a new session: only the old session is gone
                except StoreError:
                    sock.close()
                    raise
                except OSError as exc:
                    sock.close()
                    last = exc
                    patience.failed(_describe(exc))
            remaining = deadline - _monotonic()
            if remaining <= 0:
                if lost is not None:
                    raise StoreConnectionError(
                        f"lost the connection to the store server at {addr} ({_describe(lost)}) "
                        f"and could not reconnect: {_describe(last)}"
                    ) from last
                raise StoreConnectionError(
                    f"could not connect to the store server at {addr}: {_describe(last)} "
                    f"(tried for {self._timeout:g} s)"
                ) from last
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_BACKOFF)

    def _error(self, status: int, payload: bytes, what: str, key: str | None) -> StoreError:
        about = f"{what}({key!r})" if key is not None else what
        if status != P.STATUS_ERROR:
            return StoreProtocolError(f"unexpected response status {status} to {about}")
        code, msg = P.decode_error(payload)
        if code == P.E_VALUE:
            return StoreValueError(msg)
        if code == P.E_AUTH:
            return StoreAuthenticationError(msg)
        if code == P.E_SESSION:
            return SessionExpiredError(msg)
        if code in (P.E_BAD_REQUEST, P.E_UNKNOWN_OP, P.E_FRAME_TOO_LARGE, P.E_VERSION):
            return StoreProtocolError(
                f"the store server at {self._host}:{self._port} rejected {about}: {msg}", code
            )
        return StoreError(f"the store server at {self._host}:{self._port} failed {about}: {msg}")

    # -- keepalive --------------------------------------------------------------------------------
    def _keepalive_due(self) -> float:
        return self._last_send + self._ping_every

    def _keepalive(self) -> None:
        if self._closed or not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed or _monotonic() - self._last_send < self._ping_every:
                return
            rid = self._rid = self._rid + 1
            try:
                self._request(P.encode_ping(rid), rid, _monotonic() + self._ping_every, report=False)
            except SessionExpiredError as exc:
                self._pending_error = exc
            except (StoreError, OSError) as exc:
                self._last_send = _monotonic()  # retry at the next period, not at once
                log.debug("keepalive to %s:%d failed: %s", self._host, self._port, exc)
        finally:
            self._lock.release()

