"""The TCPStore's connection: requests and answers, pipelining, reconnects, keepalive.

:class:`StoreConnection` is what a :class:`~rdzv.store.TCPStore` talks to its server through:
one blocking socket (``TCP_NODELAY``) under one lock. It numbers each request (under the lock,
so that the ids reach the server in order), sends it and reads its answer, sends the void writes
without waiting (*pipelined*: their answers, or for quiet SETs the answer to any later request,
confirm them in order; its :class:`~._tcp_pipeline.Pipeline` keeps them), and re-establishes a
lost connection within the call's timeout, with backoff: :func:`~._tcp_handshake.handshake`
greets the server, resuming the session, and every unconfirmed write is resent, in order (after
a session expired, only what is safe to apply again). The server's error answers become rdzv
errors (:mod:`._tcp_errors`). The keepalive thread of the process (:mod:`._keepalive`) pings it
when idle for ``session_ttl / 3`` seconds by its clock (injected: :mod:`rdzv._clock`; the waits
on the socket are bounded by the system's clock, since they are real).

A request is given as an encoder of :mod:`rdzv.kv.protocol` and its arguments after the request
id: ``encode(rid, *args)`` is called with the lock held, once the id is drawn.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Callable, Sequence

from .._clock import SYSTEM_CLOCK, Clock
from .._patience import Patience
from ..errors import SessionExpiredError, StoreError
from ..kv import protocol as P
from . import _tcp_errors as E
from ._keepalive import KEEPALIVE
from ._tcp_handshake import HANDSHAKE_TIMEOUT, handshake, set_reply_timeout
from ._tcp_pipeline import MAX_UNACKED_BYTES, MAX_UNACKED_WRITES, Pipeline

log = logging.getLogger("rdzv.store.tcp")

Encoder = Callable[..., bytes]
"""A request encoder: ``encode(rid, *args)`` is the request's frame."""

_MAX_BACKOFF = 1.0
CLOSE_PATIENCE = 0.1
"""Seconds close() waits for a request of another thread to finish before it interrupts it
(a blocking wait or watch holds the connection for up to a keepalive period)."""
_monotonic = time.monotonic


class StoreConnection:
    """The connection of a :class:`~rdzv.store.TCPStore` to ``host:port`` (see the module
    docstring). Thread safe; not open until :meth:`open`."""

    def __init__(
        self, host: str, port: int, secret: bytes | None, session_ttl: float, timeout: float,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.host = host
        self.port = port
        self.addr = f"{host}:{port}"
        self.timeout = timeout
        """The store's timeout in seconds: how long a request retries a lost connection."""
        self._secret = secret
        self._ttl = session_ttl
        self.ping_every = session_ttl / 3.0 if session_ttl > 0 else 60.0
        """The keepalive period, and the longest server-side wait of a blocking call."""
        # How long to wait for any answer before taking the server for dead (and reconnecting):
        # longer than the longest server-side wait (one slice), and fixed, so that the socket
        # option is set once per connection.
        self._reply_timeout = max(2.0 * self.ping_every + 1.0, 5.0)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._stale: socket.socket | None = None
        self._rid = 0
        self.session = 0
        """The server's id of this client's session (0 before the first connection)."""
        self._token = b""
        """The resume token of the session (the proof that it is this client's)."""
        self._had_ephemeral = False
        self._pipe = Pipeline(self.addr)
        self._closed = False
        self._interrupted = False
        """close() cut the connection under another thread's request, which then fails."""
        self._pending_error: BaseException | None = None
        """An error of the keepalive's ping (the session expired) for the next call to raise."""
        self._now = clock.monotonic
        """The clock that says when the connection is idle (its keepalive's decision)."""
        self._last_send = self._now()
        self._batch_owner: int | None = None
        """The thread in a batch (only its writes are held)."""
        self._batch_depth = 0

    # -- what the store calls ---------------------------------------------------------------------
    def open(self, deadline: float) -> None:
        """Connect (retrying until ``deadline``) and have the keepalive ping this connection."""
        with self._lock:
            self._connect(deadline, None)
        KEEPALIVE.register(self)

    def request(
        self, encode: Encoder, args: tuple[Any, ...], deadline: float | None = None, *,
        ephemeral: bool = False,
    ) -> tuple[int, bytes]:
        """(status, payload) of the answer to the request ``encode(rid, *args)``.

        A lost connection is re-established until ``deadline`` (default: :attr:`timeout` from
        then), and the unacknowledged writes and this request are resent, in order; the server
        applies none of them twice. Raises the error of an earlier pipelined write that the
        answers read on the way report. ``ephemeral``: the request writes an ephemeral key.
        """
        with self._lock:
            rid = self._rid = self._rid + 1
            result = self._request(encode(rid, *args), rid, deadline)
            if ephemeral:
                self._had_ephemeral = True
        return result

    def call(self, encode: Encoder, args: tuple[Any, ...], what: str, key: str | None = None) -> bytes:
        """The payload of the answer to ``encode(rid, *args)``; an error answer raises (the
        error of ``what``, about ``key``)."""
        with self._lock:
            rid = self._rid = self._rid + 1
            status, payload = self._request(encode(rid, *args), rid)
        if status:
            raise self.error(status, payload, what, key)
        return payload

    def send_write(
        self, encode: Encoder, args: tuple[Any, ...], what: str, key: str | None, *,
        ephemeral: bool = False,
    ) -> None:
        """Send the void write ``encode(rid, *args)`` without waiting for its answer.

        The write is kept until acknowledged (to be resent after a reconnect); with too many
        unacknowledged, or no connection, this waits for the answers (reconnecting if needed).
        A write that fails is raised by the next call that reads an answer, naming it
        (``what``, ``key``).
        """
        with self._lock:
            rid = self._rid = self._rid + 1
            frame = encode(rid, *args)
            if self._pending_error is not None:
                exc, self._pending_error = self._pending_error, None
                raise exc
            pipe = self._pipe
            size = len(frame)
            if size > pipe.max_frame + 4:
                self._check_frame_size(frame)
            unacked = pipe.unacked
            unacked.append((rid, frame, what, key))
            pipe.unacked_bytes += size
            room = len(unacked) <= MAX_UNACKED_WRITES and pipe.unacked_bytes <= MAX_UNACKED_BYTES
            sock = self._sock
            if sock is not None and self._batch_owner == threading.get_ident() and room:
                pipe.held.append(frame)  # (already in unacked: resent if the connection drops)
            else:
                if sock is not None:
                    try:  # (not counted as a sign of life: the keepalive may ping a busy writer)
                        sock.sendall(pipe.with_held(frame) if pipe.held else frame)
                    except OSError as exc:
                        log.debug("connection to %s lost: %s", self.addr, exc)
                        self._disconnect(exc)
                        sock = None
                if sock is None or not room:  # wait for the answers (reconnecting if needed)
                    ping = self._rid = self._rid + 1
                    self._request(P.encode_ping(ping), ping)
            if ephemeral:
                self._had_ephemeral = True

    def exchange_many(self, requests: Sequence[tuple[Encoder, bytes]]) -> list[tuple[int, bytes]]:
        """Send the read-only requests ``encode(rid, arg)`` in one write, then read their
        answers, (status, payload) each: one round trip.

        Reads are idempotent: if the connection is lost, the ones not yet answered are sent
        again, one by one, over the new connection.
        """
        with self._lock:
            pipe = self._pipe
            first = self._rid + 1
            self._rid += len(requests)
            frames = [encode(first + i, arg) for i, (encode, arg) in enumerate(requests)]
            for frame in frames:
                self._check_frame_size(frame)
            answers: list[tuple[int, bytes]] = []
            sock = self._sock
            if sock is not None and self._pending_error is None:
                try:
                    self._last_send = self._now()
                    sock.sendall(pipe.with_held(b"".join(frames)))
                    for i in range(len(frames)):
                        answers.append(pipe.read(sock, first + i))
                except StoreError:
                    self._disconnect()
                    raise
                except OSError as exc:
                    log.debug("connection to %s lost: %s", self.addr, exc)
                    self._disconnect(exc)
            deadline = _monotonic() + self.timeout
            for i in range(len(answers), len(frames)):
                answers.append(self._request_slow(frames[i], first + i, deadline, None))
            if pipe.write_error is not None:
                err, pipe.write_error = pipe.write_error, None
                raise err
            return answers

    def flush(self) -> None:
        """Wait until the server has acknowledged every earlier write; raise the error of one
        that failed."""
        with self._lock:
            if not self._pipe.unacked and self._pipe.write_error is None:
                return
            rid = self._rid = self._rid + 1
            status, payload = self._request(P.encode_ping(rid), rid)
        if status:
            raise self.error(status, payload, "flush", None)

    def begin_batch(self) -> bool:
        """Open a batch of this thread: its writes are held back until its next request, at
        the latest until :meth:`end_batch`. False (nothing held, no end_batch to call) while
        another thread's batch is open."""
        me = threading.get_ident()
        with self._lock:
            if self._batch_owner is None:
                self._batch_owner = me
            mine = self._batch_owner == me
            self._batch_depth += mine
        return mine

    def end_batch(self) -> None:
        """End this thread's (innermost) batch; the outermost sends the held writes."""
        with self._lock:
            self._batch_depth -= 1
            if not self._batch_depth:
                self._batch_owner = None
                self._send_held()

    def close(self) -> None:
        """End the session (its ephemeral keys go at once) and close the connection.

        Pipelined writes not yet acknowledged are confirmed first (reconnecting for at most
        5 s); if that fails it is logged, not raised. A request of another thread still under
        way after :data:`CLOSE_PATIENCE` (a blocking wait) is cut short: it raises StoreError,
        and the server ends the session with the connection (writes still unconfirmed then are
        logged as possibly lost).
        """
        if not self._lock.acquire(timeout=CLOSE_PATIENCE):
            self._interrupted = True  # (the server ends the session with its connection)
            sock = self._sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._lock.acquire()
        try:
            if not self._closed:
                if self._pipe.unacked or self._pipe.write_error is not None:
                    self._flush_before_close()
                self._closed = True
                sock = self._sock
                if sock is not None:
                    try:
                        rid = self._rid = self._rid + 1
                        set_reply_timeout(sock, 5.0)
                        sock.sendall(P.encode_close_session(rid))
                        self._pipe.read(sock, rid)
                    except (OSError, StoreError):
                        pass
                    self._disconnect()
                self._close_stale()
        finally:
            self._lock.release()
        KEEPALIVE.unregister(self)

    def error(self, status: int, payload: bytes, what: str, key: str | None) -> StoreError:
        """The rdzv error for the server's error answer to ``what`` (about ``key``)."""
        return E.answer_error(self.addr, status, payload, what, key)

    # -- keepalive (called by the keepalive thread) ---------------------------------------------
    def keepalive_in(self) -> float:
        """Seconds until this connection wants a ping, by its clock (<= 0: now). The session
        it keeps is timed by the server's real clock: a hand-moved clock that stands still
        longer than the ttl lets the session expire."""
        return self._last_send + self.ping_every - self._now()

    def keepalive(self) -> None:
        """Ping the server if nothing was sent for a period (and no call is under way)."""
        if self._closed or not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed or self.keepalive_in() > 0:
                return
            rid = self._rid = self._rid + 1
            try:
                self._request(P.encode_ping(rid), rid, _monotonic() + self.ping_every, report=False)
            except SessionExpiredError as exc:
                self._pending_error = exc
            except (StoreError, OSError) as exc:
                self._last_send = self._now()  # retry at the next period, not at once
                log.debug("keepalive to %s failed: %s", self.addr, exc)
        finally:
            self._lock.release()

    # -- sending (lock held) ------------------------------------------------------------------
    def _send_held(self) -> None:
        """Send the writes held back by the batch that ended."""
        sock = self._sock
        if self._pipe.held and sock is not None:
            try:
                sock.sendall(self._pipe.with_held(b""))
            except OSError as exc:  # they are resent, in order, by the next call's reconnect
                log.debug("connection to %s lost: %s", self.addr, exc)
                self._disconnect(exc)

    def _check_frame_size(self, frame: bytes) -> None:
        if len(frame) > self._pipe.max_frame + 4:
            raise E.frame_too_large(len(frame) - 4, self._pipe.max_frame)

    def _flush_before_close(self) -> None:
        """Collect the answers of the pipelined writes (reconnecting for at most 5 s), logging
        a failure: close() never raises (flush() first tells)."""
        rid = self._rid = self._rid + 1
        try:
            self._request(P.encode_ping(rid), rid, _monotonic() + min(self.timeout, 5.0))
        except StoreError as exc:
            unacked = self._pipe.unacked
            log.warning(
                "closing the store client of %s: %s%s",
                self.addr,
                f"{len(unacked)} write(s) may be lost: " if unacked else "",
                exc,
            )

    def _request(
        self, frame: bytes, rid: int, deadline: float | None = None, *, report: bool = True
    ) -> tuple[int, bytes]:
        """:meth:`request` of ``frame`` (numbered ``rid``). ``report`` false: an earlier
        write's error waits for the next call."""
        sock = self._sock
        pipe = self._pipe
        if sock is None or self._pending_error is not None or len(frame) > pipe.max_frame + 4:
            result = self._request_slow(frame, rid, deadline, None)
        else:
            try:
                self._last_send = self._now()
                sock.sendall(pipe.with_held(frame) if pipe.held else frame)
                result = pipe.read(sock, rid)
            except StoreError:
                self._disconnect()
                raise
            except OSError as exc:
                log.debug("connection to %s lost: %s", self.addr, exc)
                self._disconnect(exc)
                result = self._request_slow(frame, rid, deadline, exc)
        if report and pipe.write_error is not None:
            err, pipe.write_error = pipe.write_error, None
            raise err
        return result

    def _request_slow(
        self, frame: bytes, rid: int, deadline: float | None, reason: BaseException | None
    ) -> tuple[int, bytes]:
        if self._pending_error is not None:
            exc, self._pending_error = self._pending_error, None
            raise exc
        self._check_frame_size(frame)
        attempts = 1 if reason is not None else 0
        sent_in = self.session if reason is not None else None  # the session it may have reached
        while True:
            sock = self._sock
            if self._interrupted or (sock is None and self._closed):
                raise E.closed(self.addr)
            if sock is None:
                if deadline is None:
                    deadline = _monotonic() + self.timeout
                if attempts and _monotonic() >= deadline:
                    raise E.connection_lost(self.addr, reason, self._reply_timeout) from reason
                self._connect(deadline, reason)
                sock = self._sock
                assert sock is not None
                if self._interrupted:  # close() came while this thread reconnected
                    raise E.closed(self.addr)
                if sent_in not in (None, self.session) and not P.resendable_after_expiry(frame):
                    raise E.expired_in_flight(self.addr, sent_in, self.session, frame)
            attempts += 1
            sent_in = self.session
            try:
                self._last_send = self._now()
                sock.sendall(self._pipe.with_held(frame))
                return self._pipe.read(sock, rid)
            except StoreError:
                self._disconnect()
                raise
            except OSError as exc:
                reason = exc
                log.debug("connection to %s lost: %s", self.addr, exc)
                self._disconnect(exc)

    # -- connecting (lock held) -------------------------------------------------------------------
    def _disconnect(self, why: BaseException | None = None) -> None:
        sock = self._sock
        self._sock = None
        self._pipe.disconnected()
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
        addr = self.addr
        patience = Patience(log, f"cannot reach the store server at {addr} yet", deadline,
                            clock=_monotonic)
        while not self._interrupted:
            remaining = deadline - _monotonic()
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=max(0.05, min(remaining, HANDSHAKE_TIMEOUT))
                )
            except OSError as exc:
                last = exc
                patience.failed(E.describe(exc))
            else:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    welcome = handshake(
                        sock, addr, self._secret, self._ttl, self.session, self._token, deadline
                    )
                    self._adopt(sock, welcome)
                    return
                except SessionExpiredError:
                    raise  # connected, in a new session: only the old session is gone
                except StoreError:
                    sock.close()
                    raise
                except OSError as exc:
                    sock.close()
                    last = exc
                    patience.failed(E.describe(exc))
            remaining = deadline - _monotonic()
            if remaining <= 0:
                raise E.unreachable(addr, lost, last, self.timeout) from last
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_BACKOFF)
        raise E.closed(addr)  # by close(), from another thread

    def _adopt(self, sock: socket.socket, welcome: P.Welcome) -> None:
        """Carry on over ``sock``, whose handshake ended in ``welcome``: resend the unconfirmed
        writes (after a session expired, only those safe to apply again) and take the session.
        Raises SessionExpiredError (once connected) if the expiry lost ephemeral keys or writes."""
        sock.settimeout(None)
        set_reply_timeout(sock, self._reply_timeout)
        pipe, addr = self._pipe, self.addr
        old = self.session
        expired = bool(old) and not welcome.resumed
        # What the expired session may or may not have applied is resent only where that is
        # harmless (docs/protocol.md, "Session expiry"): its ephemeral writes died with it.
        dropped = pipe.drop_unresendable() if expired else []
        if pipe.unacked:  # resent first, in order: the server applies each at most once
            sock.sendall(pipe.unconfirmed())
        self._close_stale()  # the server moved the session to this connection
        self._sock = sock
        self.session = welcome.session
        self._token = welcome.token
        pipe.max_frame = welcome.max_frame_size
        if expired:
            log.warning(
                "store session %d at %s ended while disconnected; continuing in session %d",
                old,
                addr,
                welcome.session,
            )
            if self._had_ephemeral or dropped:
                had_ephemeral, self._had_ephemeral = self._had_ephemeral, False
                raise E.expired_while_disconnected(
                    addr, old, welcome.session, had_ephemeral, dropped
                )
        elif old:
            log.info("resumed store session %d at %s", old, addr)
