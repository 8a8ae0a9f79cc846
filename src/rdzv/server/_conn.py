"""One client connection: framing, the handshake, then requests dispatched to the core.

:class:`Conn` is an asyncio BufferedProtocol. It splits the byte stream into frames, runs the
handshake (version, optional shared-secret auth, session attach/resume), hands each request to
the core's handlers, writes the answers (holding back a client that does not read them), and
ends the session of a client that stays silent for its ttl.
"""

from __future__ import annotations

import asyncio
import logging
import select
import struct
import time
from typing import TYPE_CHECKING

from ..errors import StoreValueError
from . import _auth
from . import protocol as P

if TYPE_CHECKING:
    from ._core import Core, Session
    from ._waiters import Waiter

log = logging.getLogger("rdzv.server")
_ok = P.ok
_monotonic = time.monotonic
_LEN_unpack_from = P.LEN.unpack_from
_HEAD_unpack_from = P.BODY_HEAD.unpack_from

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to complete the handshake."""
_READY = 2
_AUTH = 1
_HELLO = 0


class Conn(asyncio.BufferedProtocol):
    """One client connection: framing, handshake, then requests dispatched to the core.

    A BufferedProtocol: the loop reads into one buffer shared by all connections (asyncio's
    plain Protocol allocates a fresh 256 KiB object per read, which costs more than the request).
    """

    def __init__(self, core: "Core") -> None:
        self.core = core
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.peer = "?"
        self.phase = _HELLO
        self.session: Session | None = None
        self.ttl = 0.0
        self.last_recv = 0.0
        self.chunks: list[bytes] | None = None
        self.chunks_len = 0
        self.need = 0
        self.out: list[bytes] = []
        self.out_size = 0
        self.deferred: bytes | None = None
        self.write_paused = False
        self.dirty = False
        self.waiters: set[Waiter] = set()
        self.hello: P.Hello | None = None
        self.server_nonce = b""
        self.timer: asyncio.TimerHandle | None = None
        self.timer_due = 0.0
        self.closed = False
        self.closing = False
        self.max_frame = P.HANDSHAKE_MAX_FRAME

    # -- asyncio callbacks ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        core = self.core
        if core.stopping or core.failed is not None:
            self.transport.abort()
            return
        core.conns.add(self)
        transport.set_write_buffer_limits(  # type: ignore[attr-defined]
            high=core.out_high, low=core.out_high // 4
        )
        self.last_recv = _monotonic()
        self.timer = core.loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        core = self.core
        core.conns.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for w in list(self.waiters):
            core.remove_waiter(w)
        sess = self.session
        self.session = None
        self.out = []
        if sess is not None and sess.conn is self and not core.stopping and core.failed is None:
            log.debug("connection from %s closed; ending its session %d", self.peer, sess.id)
            core.end_session(sess)
            core.request_commit()

    def pause_writing(self) -> None:
        # The client does not read its responses: stop reading its requests until it does.
        self.write_paused = True
        if not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.closed:
            return
        # The client drained our answers: it is alive even if its requests wait unread (a stopped
        # process reads nothing), so its ttl counts from here.
        self.last_recv = _monotonic()
        if self.deferred is not None:
            self.core.loop.call_soon(self._resume_deferred)
        else:
            self.transport.resume_reading()

    def _resume_deferred(self) -> None:
        """Go on with requests left unprocessed while this client's answers piled up."""
        data = self.deferred
        if data is None or self.closed or self.write_paused:
            return
        self.deferred = None
        self.data_received(data)
        if self.deferred is None and not self.write_paused and not self.closed:
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.core.rview

    def buffer_updated(self, nbytes: int) -> None:
        core = self.core
        self.last_recv = _monotonic()
        data = core.rview[:nbytes].tobytes()
        if self.chunks is None and self.phase == _READY and core.wal is None:
            # Fast path: whole requests answered by one write (a synchronous or pipelining client).
            pos = self._answer_whole_requests(data, nbytes)
            if pos == nbytes:
                if core.dirty:
                    core.request_commit()
                return
            data = data[pos:]
        self.data_received(data)

    def _answer_whole_requests(self, data: bytes, size: int) -> int:
        """Answer the whole requests at the start of ``data`` (in-memory server); where they end.

        Stops before anything the general path handles (a partial, short or oversized frame, a
        closing connection, answers beyond the write buffer's high-water mark).
        """
        pos = 0
        out: list[bytes] = []
        out_size = 0
        max_frame = self.max_frame
        out_high = self.core.out_high
        while size - pos >= 9:
            length = _LEN_unpack_from(data, pos)[0]
            end = pos + 4 + length
            if end > size or length > max_frame or length < P.HEAD_SIZE or out_size > out_high:
                break
            resp = self._request(data, pos + 4, end)
            pos = end
            if resp is not None:
                out.append(resp)
                out_size += len(resp)
            if self.closing or self.closed:
                break
        if out and not self.closed:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
            if self.closing:
                self.transport.close()
                self.closed = True
        return size if self.closed else pos

    def data_received(self, data: bytes) -> None:
        core = self.core
        chunks = self.chunks
        if chunks is not None:
            chunks.append(data)
            self.chunks_len += len(data)
            if self.chunks_len < self.need:
                return
            data = b"".join(chunks)
            self.chunks = None
        size = len(data)
        pos = 0
        try:
            while size - pos >= 4:
                (length,) = _LEN_unpack_from(data, pos)
                if length > self.max_frame:
                    self._oversized(length)
                    break
                end = pos + 4 + length
                if end > size:
                    rest = data[pos:]
                    self.chunks = [rest]
                    self.chunks_len = len(rest)
                    self.need = 4 + length
                    break
                if self.phase == _READY:
                    resp = self._request(data, pos + 4, end)
                    if resp is not None:
                        self.queue(resp)
                        self.out_size += len(resp)
                else:
                    self._handshake(data[pos + 4 : end])
                if self.closed or self.closing:
                    break
                pos = end
                if self.out_size > core.out_high and pos < size:
                    # Answers pile up: the rest waits until the client has read them.
                    self.deferred = data[pos:]
                    self.transport.pause_reading()
                    self.core.loop.call_soon(self._resume_deferred)
                    break
            else:
                if pos < size:  # fewer than 4 bytes of the next frame
                    self.chunks = [data[pos:]]
                    self.chunks_len = size - pos
                    self.need = 4
        except P.ProtocolError as exc:
            self.drop(f"protocol error: {exc}", P.error(0, exc.code, str(exc)))
        if core.dirty:
            core.request_commit()

    # -- requests ---------------------------------------------------------------------------------
    def _request(self, buf: bytes, pos: int, end: int) -> bytes | None:
        """The response to the request in ``buf[pos:end]`` (None: answered later)."""
        if end - pos < P.HEAD_SIZE:
            raise P.ProtocolError(f"request frame of {end - pos} bytes is shorter than its header")
        op, rid = _HEAD_unpack_from(buf, pos)
        core = self.core
        mutating = core.mutating[op]
        sess = self.session
        if mutating and rid <= sess.last_rid:  # type: ignore[union-attr]
            return self._resent(op, rid)
        try:
            resp = core.handlers[op](self, rid, buf, pos + P.HEAD_SIZE, end)
        except P.ProtocolError as exc:
            log.warning("bad request from %s: %s", self.peer, exc)
            return P.error(rid, exc.code, str(exc))
        except (struct.error, UnicodeDecodeError) as exc:
            msg = f"malformed {P.OP_NAMES.get(op, op)} request: {exc}"
            log.warning("bad request from %s: %s", self.peer, msg)
            return P.error(rid, P.E_BAD_REQUEST, msg)
        except StoreValueError as exc:
            return P.error(rid, P.E_VALUE, str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the server
            log.exception("error answering a %s request from %s", P.OP_NAMES.get(op, op), self.peer)
            return P.error(rid, P.E_INTERNAL, f"{type(exc).__name__}: {exc}")
        if mutating:
            sess.last_rid = rid  # type: ignore[union-attr]
            sess.last_resp = resp  # type: ignore[union-attr]
        return resp

    def _resent(self, op: int, rid: int) -> bytes | None:
        """The answer to a write resent after a reconnect, which was applied already."""
        sess = self.session
        assert sess is not None
        if rid == sess.last_rid:
            return sess.last_resp  # None: a quiet SET that succeeded
        if op in P.PIPELINED_OPS:
            return _ok(rid)  # an earlier pipelined write: its answer was "done"
        return P.error(
            rid,
            P.E_BAD_REQUEST,
            f"{P.OP_NAMES[op]} request {rid} was applied already (the last write of session "
            f"{sess.id} is request {sess.last_rid}); request ids must grow",
        )

    def queue(self, frame: bytes) -> None:
        """Queue a response for the next commit (woken waiters, timeouts)."""
        if self.closed:
            return
        if not self.dirty:
            self.dirty = True
            self.core.dirty.append(self)
        self.out.append(frame)

    def flush_out(self) -> None:
        self.dirty = False
        self.out_size = 0
        out = self.out
        if not out or self.closed:
            return
        self.out = []
        transport = self.transport
        transport.write(out[0] if len(out) == 1 else b"".join(out))
        if self.closing:
            transport.close()
            self.closed = True
        elif transport.get_write_buffer_size() > self.core.out_limit:
            self.drop(
                f"it does not read its responses ({transport.get_write_buffer_size()} bytes "
                "waiting to be sent)"
            )

    def drop(self, why: str, last_frame: bytes | None = None) -> None:
        """Close this connection (after ``last_frame``, if given), logging why."""
        if self.closed:
            return
        log.warning("dropping the connection from %s: %s", self.peer, why)
        self.closed = True
        self.out = []
        if last_frame is not None:
            self.transport.write(last_frame)
            self.transport.close()
        else:
            self.transport.abort()

    def _oversized(self, length: int) -> None:
        msg = f"frame of {length} bytes exceeds the maximum frame size of {self.max_frame} bytes"
        if self.phase != _READY:
            self.drop(f"bad handshake ({msg}; not an rdzv client?)")
        else:
            self.drop(msg, P.error(0, P.E_FRAME_TOO_LARGE, msg))

    # -- handshake -------------------------------------------------------------------------------
    def _handshake(self, body: bytes) -> None:
        core = self.core
        self.last_recv = _monotonic()
        if self.phase == _HELLO:
            try:
                hello = P.decode_hello(body)
            except P.ProtocolError as exc:
                self.drop(f"bad handshake: {exc}")
                return
            if hello.version != P.PROTOCOL_VERSION:
                msg = (
                    f"protocol version mismatch: the server speaks version {P.PROTOCOL_VERSION}, "
                    f"the client version {hello.version}"
                )
                self.drop(msg, P.encode_challenge(P.HS_VERSION_MISMATCH, False, message=msg))
                return
            self.hello = hello
            self.server_nonce = _auth.new_nonce(P.NONCE_SIZE)
            self.phase = _AUTH
            self.transport.write(
                P.encode_challenge(P.HS_OK, core.secret is not None, self.server_nonce)
            )
            return
        # AUTH
        if self.hello is None:  # pragma: no cover - phases guarantee it
            raise P.ProtocolError("AUTH before HELLO")
        hello = self.hello
        try:
            mac = P.decode_auth(body)
        except P.ProtocolError as exc:
            self.drop(f"bad handshake: {exc}")
            return
        proof = b""
        if core.secret is not None:
            expected = _auth.client_proof(core.secret, hello.nonce, self.server_nonce)
            if not mac or not _auth.verify(expected, mac):
                why = (
                    "the server requires a shared secret and the client sent none"
                    if not mac
                    else "the client's secret does not match the server's"
                )
                self.drop(
                    f"authentication failed: {why}",
                    P.encode_welcome(P.HS_AUTH_FAILED, message=f"authentication failed: {why}"),
                )
                return
            proof = _auth.server_proof(core.secret, hello.nonce, self.server_nonce)
        sess, resumed = core.attach_session(self, hello)
        self.session = sess
        self.ttl = hello.ttl
        self.phase = _READY
        self.max_frame = core.max_frame_size
        self.hello = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if hello.ttl > 0:
            self._arm_ttl(self.last_recv + hello.ttl)
        self.queue(
            P.encode_welcome(P.HS_OK, sess.id, resumed, core.max_frame_size, hello.ttl, proof)
        )
        log.debug("%s: session %d %s", self.peer, sess.id, "resumed" if resumed else "opened")

    def _readable(self) -> bool:
        """Whether bytes (or the end of the stream) wait unread on this connection's socket."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            return bool(select.select([sock.fileno()], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def _handshake_timeout(self) -> None:
        self.timer = None
        if self.phase != _READY:
            self.drop(f"no handshake within {HANDSHAKE_TIMEOUT:g} s")

    def _arm_ttl(self, when: float) -> None:
        self.timer_due = when
        self.timer = self.core.loop.call_at(when, self._ttl_check)

    def _ttl_check(self) -> None:
        self.timer = None
        if self.closed:
            return
        now = self.core.loop.time()
        deadline = self.last_recv + self.ttl
        if now < deadline:
            self._arm_ttl(deadline)
            return
        if now - self.timer_due > max(1.0, 0.25 * self.ttl):
            # This check runs late: the server itself stalled (stopped, swapped out, busy), so
            # the client's silence proves nothing. Give it a fresh window.
            self.last_recv = now
            self._arm_ttl(now + self.ttl)
            return
        if self._readable() and not self.write_paused and self.deferred is None:
            self._arm_ttl(now + 0.05)  # its frames arrived but are not read yet
            return
        core = self.core
        sess = self.session
        log.warning(
            "client %s sent nothing for %g s (its session ttl): ending session %s",
            self.peer,
            self.ttl,
            sess.id if sess else "-",
        )
        self.session = None
        self.drop("session ttl expired")
        if sess is not None and sess.conn is self:
            core.end_session(sess)
            core.request_commit()

