"""TCPStore: a client of the rdzv store server, with torch's ``TCPStore`` constructor.

One TCP connection per store object (``TCP_NODELAY``, blocking socket, one lock: thread safe),
one round trip per call, except for the void writes ``set`` and ``multi_set``: like torch's
``TCPStore.set`` they return once the request is sent (*pipelined*). Their acknowledgements are
collected, in order, by the next call that waits for an answer (any read or returning write), by
:meth:`TCPStore.flush`, or by ``close()``; a pipelined write that failed is raised by that next
call, naming the write. At most ``MAX_UNACKED_WRITES`` (or ``MAX_UNACKED_BYTES``) stay
unacknowledged; beyond that a write waits for the earlier acknowledgements. The connection carries a *session*: keys set with ``ephemeral=True``
live as long as it. A keepalive thread pings an idle connection every ``session_ttl / 3``
seconds, and blocking calls wait on the server in chunks of at most that long, so a live client
never looks dead; a client that is killed, hung or cut off loses its ephemeral keys.

A lost connection is re-established (with backoff, within the call's timeout) and the session
resumed, so a client carries on across a restart of a durable server. Every unacknowledged write
is resent after a reconnect, in order; the server applies none twice (it remembers the last write
request id of each session and answers a resent one without applying it).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import weakref
from collections import deque
from typing import Callable, Sequence

from ..errors import (
    SessionExpiredError,
    StoreAuthenticationError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreTimeoutError,
    StoreValueError,
)
from ..server import _auth
from ..server import protocol as P
from ._base import (
    DEFAULT_SESSION_TTL,
    DEFAULT_TIMEOUT,
    Store,
    StoreCapabilities,
    Timeout,
    Value,
    check_key,
    timeout_error,
    to_bytes,
    to_seconds,
)

log = logging.getLogger("rdzv.store.tcp")

INIT_KEY = "init/"
"""The counter that clients increment when created with a world size (as torch's do)."""
HANDSHAKE_TIMEOUT = 10.0
_MAX_BACKOFF = 1.0
MAX_UNACKED_WRITES = 256
"""Pipelined writes a client may have unacknowledged before a write waits for their answers."""
MAX_UNACKED_BYTES = 4 << 20
"""... and their total size in bytes (the client keeps them to resend after a reconnect)."""
_RESP = P.RESP_HEAD
_OK = P.STATUS_OK
_TIMEOUT = P.STATUS_TIMEOUT
_monotonic = time.monotonic
_SO_RCVTIMEO: int | None = getattr(socket, "SO_RCVTIMEO", None)
_SO_SNDTIMEO: int | None = getattr(socket, "SO_SNDTIMEO", None)


class _ConnectionLost(ConnectionError):
    """The server closed the connection (internal: triggers a reconnect)."""


def _describe(exc: BaseException | None, reply_timeout: float | None = None) -> str:
    if exc is None:
        return "not connected"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (BlockingIOError, socket.timeout)):
        return f"no reply within {reply_timeout:g} s" if reply_timeout else "timed out"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def _bind_host(host_name: str) -> str:
    """Where an embedded server listens: loopback names as given, else every interface."""
    if host_name in ("localhost", "::1") or host_name.startswith("127."):
        return host_name
    return "::" if ":" in host_name else "0.0.0.0"


class TCPStore(Store):
    """A store served by an rdzv store server (``rdzv serve``, or embedded with ``is_master``).

    The arguments are torch's: ``is_master=True`` starts a :class:`~rdzv.server.StoreServer` in
    this process (port 0 picks a free port; :attr:`port` tells it), and with ``world_size`` (and
    ``wait_for_workers``) every client counts itself in and the master waits for all of them.
    ``multi_tenant`` and ``use_libuv`` are accepted and ignored (the server is always shared);
    ``master_listen_fd`` is a listening socket the embedded server takes over.

    ``secret`` (default: ``$RDZV_STORE_SECRET``) authenticates this client to the server and the
    server to it. ``session_ttl`` is how long the server keeps this client's ephemeral keys after
    it stops hearing from it (0: only until the connection closes).
    """

    capabilities = StoreCapabilities(watch=True, ephemeral=True, listing=True, multi_process=True)

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        secret: _auth.Secret = None,
        session_ttl: float = DEFAULT_SESSION_TTL,
    ) -> None:
        super().__init__(timeout)
        session_ttl = float(session_ttl)
        if not session_ttl >= 0:
            raise ValueError(f"session_ttl must be >= 0, got {session_ttl}")
        self._host = host_name
        self._port = int(port)
        self._secret = _auth.normalize_secret(secret) if secret is not None else _auth.secret_from_env()
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
        self._had_ephemeral = False
        self._max_frame = P.DEFAULT_MAX_FRAME_SIZE
        self._closed = False
        self._pending_error: BaseException | None = None
        self._unacked: deque[tuple[int, bytes, str, str | None]] = deque()
        """Pipelined writes sent but not yet acknowledged: (request id, frame, op name, key)."""
        self._unacked_bytes = 0
        self._write_error: StoreError | None = None
        self._last_send = _monotonic()
        self._server = None
        self._finalizer: weakref.finalize | None = None
        try:
            if is_master:
                from ..server import StoreServer

                sock = None
                if master_listen_fd is not None:
                    sock = socket.socket(fileno=master_listen_fd)
                server = StoreServer(
                    _bind_host(host_name), self._port, secret=self._secret, sock=sock
                ).start()
                self._server = server
                self._port = server.port
                self._finalizer = weakref.finalize(self, server.stop)
            deadline = _monotonic() + self._timeout
            with self._lock:
                self._connect(deadline, None)
            _KEEPALIVE.register(self)
            if world_size is not None and wait_for_workers:
                self.add(INIT_KEY, 1)
                if is_master:
                    self._wait_for_workers(int(world_size), deadline)
        except BaseException:
            self.close()
            raise

    # -- torch's attributes -------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def session_id(self) -> int:
        """The server's id of this client's session (0 before the first connection)."""
        return self._session

    @property
    def server(self):  # type: ignore[no-untyped-def]
        """The embedded :class:`~rdzv.server.StoreServer` of a master store, else None."""
        return self._server

    def __repr__(self) -> str:
        return f"TCPStore({self._host}:{self._port}, session {self._session})"

    # -- writes ---------------------------------------------------------------------------------
    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        if key.__class__ is not str or not key:
            check_key(key)
        kb = key.encode()
        vb = value if value.__class__ is bytes else to_bytes(value)
        with self._lock:
            rid = self._rid = self._rid + 1
            self._send_write(P.encode_set(rid, kb, vb, ephemeral, True), rid, "set", key)
            if ephemeral:
                self._had_ephemeral = True

    def add(self, key: str, amount: int) -> int:
        kb = check_key(key).encode()
        try:
            with self._lock:
                rid = self._rid = self._rid + 1
                status, payload = self._request(P.encode_add(rid, kb, int(amount)), rid)
        except struct.error:
            raise StoreValueError(f"add({key!r}, {amount}): the amount is not a 64-bit integer") from None
        if status:
            raise self._error(status, payload, "add", key)
        return int(payload)

    def compare_set(
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        kb = check_key(key).encode()
        exp, des = to_bytes(expected), to_bytes(desired)
        with self._lock:
            rid = self._rid = self._rid + 1
            status, payload = self._request(P.encode_compare_set(rid, kb, exp, des, ephemeral), rid)
            if ephemeral:
                self._had_ephemeral = True
        if status:
            raise self._error(status, payload, "compare_set", key)
        return payload

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        kbs = [check_key(k).encode() for k in keys]
        vbs = [to_bytes(v) for v in values]
        if len(kbs) != len(vbs):
            raise StoreValueError(f"multi_set got {len(kbs)} keys but {len(vbs)} values")
        if not kbs:
            return
        with self._lock:
            rid = self._rid = self._rid + 1
            self._send_write(P.encode_multi_set(rid, kbs, vbs), rid, "multi_set", keys[0])

    def append(self, key: str, value: Value) -> None:
        kb = check_key(key).encode()
        vb = to_bytes(value)
        self._simple(lambda rid: P.encode_append(rid, kb, vb), "append", key)

    def delete_key(self, key: str) -> bool:
        kb = check_key(key).encode()
        return P.decode_bool(self._simple(lambda rid: P.encode_delete(rid, kb), "delete_key", key))

    # -- reads ------------------------------------------------------------------------------------
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
                P.encode_get(rid, key.encode(), True, self._chunk_ms), rid, started + timeout
            )
        if status == _OK:
            return payload
        if status != _TIMEOUT:
            raise self._error(status, payload, "get", key)
        if _monotonic() >= started + timeout:
            raise timeout_error([key], timeout)
        return self._get1(key, timeout, started + timeout)

    def try_get(self, key: str) -> bytes | None:
        kb = check_key(key).encode()
        payload = self._simple(lambda rid: P.encode_get(rid, kb, False), "try_get", key)
        if not payload:
            raise StoreProtocolError("malformed try_get response")
        return payload[1:] if payload[0] else None

    def check(self, keys: Sequence[str]) -> bool:
        kbs = [check_key(k).encode() for k in keys]
        if not kbs:
            return True
        return P.decode_bool(self._simple(lambda rid: P.encode_check(rid, kbs), "check"))

    def num_keys(self) -> int:
        return P.decode_u64(self._simple(P.encode_num_keys, "num_keys"))

    def list_keys(self, prefix: str) -> dict[str, bytes]:
        pb = prefix.encode()
        return P.decode_items(self._simple(lambda rid: P.encode_list_keys(rid, pb), "list_keys"))

    def count_keys(self, prefix: str) -> int:
        pb = prefix.encode()
        return P.decode_u64(self._simple(lambda rid: P.encode_count_keys(rid, pb), "count_keys"))

    def revision(self, path: str = "") -> int:
        pb = path.encode()
        return P.decode_u64(self._simple(lambda rid: P.encode_revision(rid, pb), "revision"))

    def ping(self) -> None:
        """One round trip to the server (reconnecting if needed)."""
        self._simple(P.encode_ping, "ping")

    def flush(self) -> None:
        """Wait until the server has acknowledged every earlier write of this client.

        ``set`` and ``multi_set`` return once their request is sent (as torch's ``set``); after
        ``flush()`` they are applied (and, on a server with a data dir, durable) and visible to
        every other client. Raises the error of a write that failed. Any call that returns an
        answer from the server (a read, ``add``, ``compare_set``...) implies the same.
        """
        with self._lock:
            if not self._unacked and self._write_error is None:
                return
            rid = self._rid = self._rid + 1
            status, payload = self._request(P.encode_ping(rid), rid)
        if status:
            raise self._error(status, payload, "flush", None)

    # -- blocking calls: server-side waits in chunks of at most ttl/3 --------------------------
    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        seconds = to_seconds(timeout, self._timeout)
        deadline = _monotonic() + seconds
        pb = path.encode()
        since = int(since)
        while True:
            done, payload = self._chunk(
                lambda rid, wait: P.encode_watch(rid, pb, since, wait), deadline, "watch", path
            )
            if not done:  # pragma: no cover - a watch is answered OK even when it runs out
                continue
            rev = P.decode_u64(payload)
            if rev > since or _monotonic() >= deadline:
                return rev

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
                raise timeout_error([key], timeout)

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
                raise timeout_error(P.decode_keys(payload) or keys, timeout)

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

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """End this client's session (its ephemeral keys go at once) and close the connection.

        Pipelined writes not yet acknowledged are confirmed first (reconnecting for at most
        10 s); if that fails it is logged, not raised (call :meth:`flush` to know). A master
        store also stops its embedded server.
        """
        with self._lock:
            if not self._closed:
                if self._unacked or self._write_error is not None:
                    self._flush_before_close()
                self._closed = True
                sock = self._sock
                if sock is not None:
                    try:
                        rid = self._rid = self._rid + 1
                        self._set_reply_timeout(sock, 5.0)
                        sock.sendall(P.encode_close_session(rid))
                        self._read_response(sock, rid)
                    except (OSError, StoreError):
                        pass
                    self._disconnect()
                self._close_stale()
        _KEEPALIVE.unregister(self)
        if self._finalizer is not None:
            self._finalizer()

    def _flush_before_close(self) -> None:
        """Collect the answers of the pipelined writes (reconnecting for at most 10 s), logging
        a failure: close() never raises; call flush() first to know. Lock held."""
        rid = self._rid = self._rid + 1
        try:
            self._request(P.encode_ping(rid), rid, _monotonic() + min(self._timeout, 10.0))
        except StoreError as exc:
            log.warning(
                "closing the store client of %s:%d: %s%s",
                self._host,
                self._port,
                f"{len(self._unacked)} write(s) may be lost: " if self._unacked else "",
                exc,
            )

    def _wait_for_workers(self, world_size: int, deadline: float) -> None:
        while True:
            rev = self.revision(INIT_KEY)
            joined = int(self.try_get(INIT_KEY) or b"0")
            if joined >= world_size:
                return
            remaining = deadline - _monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(
                    f"timed out after {self._timeout:g} s waiting for {world_size} clients to join "
                    f"the store at {self._host}:{self._port}: {joined}/{world_size} joined",
                    (INIT_KEY,),
                )
            self.watch(INIT_KEY, rev, remaining)

    # -- the wire ---------------------------------------------------------------------------------
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
        self._check_frame_size(frame)
        unacked = self._unacked
        unacked.append((rid, frame, what, key))
        self._unacked_bytes += len(frame)
        sock = self._sock
        if sock is not None:
            try:
                self._last_send = _monotonic()
                sock.sendall(frame)
            except OSError as exc:
                log.debug("connection to %s:%d lost: %s", self._host, self._port, exc)
                self._disconnect(exc)
            else:
                if len(unacked) <= MAX_UNACKED_WRITES and self._unacked_bytes <= MAX_UNACKED_BYTES:
                    return
        ping = self._rid = self._rid + 1
        self._request(P.encode_ping(ping), ping)

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

    def _request(self, frame: bytes, rid: int, deadline: float | None = None) -> tuple[int, bytes]:
        """Send ``frame`` and return (status, payload) of its response. Lock held.

        Raises the error of an earlier pipelined write that the answers read on the way report.
        """
        result = self._exchange(frame, rid, deadline)
        if self._write_error is not None:
            err, self._write_error = self._write_error, None
            raise err
        return result

    def _exchange(self, frame: bytes, rid: int, deadline: float | None = None) -> tuple[int, bytes]:
        """Send ``frame`` and return (status, payload) of its response. Lock held.

        A lost connection is re-established until ``deadline`` (default: the store timeout from
        now), and the unacknowledged writes and this request are resent, in order; the server
        applies none of them twice.
        """
        sock = self._sock
        if sock is None or self._pending_error is not None or len(frame) > self._max_frame + 4:
            return self._request_slow(frame, rid, deadline, None)
        try:
            self._last_send = _monotonic()
            sock.sendall(frame)
            return self._read_response(sock, rid)
        except StoreError:
            self._disconnect()
            raise
        except OSError as exc:
            log.debug("connection to %s:%d lost: %s", self._host, self._port, exc)
            self._disconnect(exc)
            return self._request_slow(frame, rid, deadline, exc)

    def _request_slow(
        self, frame: bytes, rid: int, deadline: float | None, reason: BaseException | None
    ) -> tuple[int, bytes]:
        if self._pending_error is not None:
            exc, self._pending_error = self._pending_error, None
            raise exc
        self._check_frame_size(frame)
        attempts = 1 if reason is not None else 0
        while True:
            sock = self._sock
            resend = b""
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
                if self._unacked:
                    resend = b"".join([f for _, f, _, _ in self._unacked])
            attempts += 1
            try:
                self._last_send = _monotonic()
                sock.sendall(resend + frame if resend else frame)
                return self._read_response(sock, rid)
            except StoreError:
                self._disconnect()
                raise
            except OSError as exc:
                reason = exc
                log.debug("connection to %s:%d lost: %s", self._host, self._port, exc)
                self._disconnect(exc)

    def _read_response(self, sock: socket.socket, rid: int) -> tuple[int, bytes]:
        buf = self._rbuf
        recv = sock.recv
        while True:
            size = len(buf)
            if size >= 9:
                length, status, r = _RESP.unpack_from(buf)
                end = length + 4
                if size >= end:
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
            chunk = recv(65536)
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

    @staticmethod
    def _set_reply_timeout(sock: socket.socket, seconds: float) -> None:
        if _SO_RCVTIMEO is not None and _SO_SNDTIMEO is not None:
            sec = int(seconds)
            tv = struct.pack("@ll", sec, int((seconds - sec) * 1e6))
            try:
                sock.setsockopt(socket.SOL_SOCKET, _SO_RCVTIMEO, tv)
                sock.setsockopt(socket.SOL_SOCKET, _SO_SNDTIMEO, tv)
                return
            except OSError:  # pragma: no cover - platform without timeval socket timeouts
                pass
        sock.settimeout(seconds)

    def _disconnect(self, why: BaseException | None = None) -> None:
        sock = self._sock
        self._sock = None
        self._rbuf = b""
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

    def _close_stale(self) -> None:
        stale, self._stale = self._stale, None
        if stale is not None:
            try:
                stale.close()
            except OSError:  # pragma: no cover
                pass

    def _connect(self, deadline: float, lost: BaseException | None) -> None:
        """Connect and handshake, retrying until ``deadline`` (a server may not be up yet)."""
        delay = 0.01
        last: BaseException | None = None
        addr = f"{self._host}:{self._port}"
        while True:
            remaining = deadline - _monotonic()
            try:
                sock = socket.create_connection(
                    (self._host, self._port), timeout=max(0.05, min(remaining, HANDSHAKE_TIMEOUT))
                )
            except OSError as exc:
                last = exc
            else:
                try:
                    self._handshake(sock, deadline)
                    return
                except StoreError:
                    sock.close()
                    raise
                except OSError as exc:
                    sock.close()
                    last = exc
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

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        addr = f"{self._host}:{self._port}"
        sock.settimeout(max(0.05, min(deadline - _monotonic(), HANDSHAKE_TIMEOUT)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(16)
        secret = self._secret
        sock.sendall(P.encode_hello(self._ttl, self._session, nonce, secret is not None))
        try:
            challenge = P.decode_challenge(self._recv_handshake(sock))
        except P.ProtocolError as exc:
            raise StoreProtocolError(f"{addr} is not an rdzv store server: {exc}") from None
        if challenge.status == P.HS_VERSION_MISMATCH:
            raise StoreProtocolError(f"the store server at {addr} refused this client: {challenge.message}")
        if challenge.status != P.HS_OK:
            raise StoreProtocolError(f"the store server at {addr} refused this client: {challenge.message}")
        if secret is not None and not challenge.auth_required:
            raise StoreAuthenticationError(
                f"this client has a shared secret but the store server at {addr} requires none; "
                "refusing to use an unauthenticated server"
            )
        mac = _auth.client_proof(secret, nonce, challenge.nonce) if secret is not None else b""
        sock.sendall(P.encode_auth(mac))
        try:
            welcome = P.decode_welcome(self._recv_handshake(sock))
        except P.ProtocolError as exc:
            raise StoreProtocolError(f"bad handshake from the store server at {addr}: {exc}") from None
        if welcome.status == P.HS_AUTH_FAILED:
            hint = "" if secret is not None else " (pass secret= or set $RDZV_STORE_SECRET)"
            raise StoreAuthenticationError(
                f"the store server at {addr} refused this client: {welcome.message}{hint}"
            )
        if welcome.status != P.HS_OK:
            raise StoreProtocolError(f"the store server at {addr} refused this client: {welcome.message}")
        if secret is not None and not _auth.verify(
            _auth.server_proof(secret, nonce, challenge.nonce), welcome.proof
        ):
            raise StoreAuthenticationError(
                f"the store server at {addr} could not prove that it knows the shared secret"
            )
        sock.settimeout(None)
        self._set_reply_timeout(sock, self._reply_timeout)
        self._close_stale()  # the server moved the session to this connection
        old = self._session
        self._sock = sock
        self._rbuf = b""
        self._session = welcome.session
        self._max_frame = welcome.max_frame_size
        if old and not welcome.resumed:
            log.warning(
                "store session %d at %s ended while disconnected; continuing in session %d",
                old,
                addr,
                welcome.session,
            )
            if self._had_ephemeral:
                self._had_ephemeral = False
                raise SessionExpiredError(
                    f"the session {old} of this client at the store server {addr} expired while "
                    f"disconnected, and its ephemeral keys with it (now in session {welcome.session})"
                )
        elif old:
            log.info("resumed store session %d at %s", old, addr)

    @staticmethod
    def _recv_handshake(sock: socket.socket) -> bytes:
        def exactly(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = sock.recv(n - len(data))
                if not chunk:
                    raise _ConnectionLost("the server closed the connection during the handshake")
                data += chunk
            return data

        (length,) = P.LEN.unpack(exactly(4))
        if length > P.HANDSHAKE_MAX_FRAME:
            raise P.ProtocolError(f"handshake frame of {length} bytes")
        return exactly(length)

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
                f"the store server at {self._host}:{self._port} rejected {about}: {msg}"
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
                self._exchange(P.encode_ping(rid), rid, _monotonic() + self._ping_every)
            except SessionExpiredError as exc:
                self._pending_error = exc
            except (StoreError, OSError) as exc:
                self._last_send = _monotonic()  # retry at the next period, not at once
                log.debug("keepalive to %s:%d failed: %s", self._host, self._port, exc)
        finally:
            self._lock.release()


class _Keepalive:
    """One thread per process pinging the idle connections of every TCPStore."""

    def __init__(self) -> None:
        self._stores: "weakref.WeakSet[TCPStore]" = weakref.WeakSet()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def register(self, store: TCPStore) -> None:
        with self._cond:
            self._stores.add(store)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rdzv-store-keepalive", daemon=True)
                self._thread.start()
            self._cond.notify()

    def unregister(self, store: TCPStore) -> None:
        with self._cond:
            self._stores.discard(store)

    def _run(self) -> None:
        while True:
            with self._cond:
                stores = list(self._stores)
            now = _monotonic()
            next_due = now + 1.0
            for store in stores:
                due = store._keepalive_due()
                if due <= now:
                    store._keepalive()
                    due = store._keepalive_due()
                    if due <= now:  # busy: its own call is on the wire
                        due = now + 0.05
                if due < next_due:
                    next_due = due
            del stores
            with self._cond:
                self._cond.wait(max(0.005, next_due - _monotonic()))


_KEEPALIVE = _Keepalive()
