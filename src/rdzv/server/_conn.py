"""One client connection: a non-blocking socket, framing, the handshake, requests and answers.

:class:`Conn` reads into one buffer shared by all connections, splits the bytes into frames,
has its handshake run (:class:`~rdzv.server._greeting.Greeting`), hands each request to the
core's handlers and sends the answers to all the requests of one read with one ``send`` (with
a write-ahead log: at the end of the loop's round, once logged). Each connection gets a bounded
turn: at most :data:`FRAMES_PER_TURN` requests (or :data:`TURN_BYTES` of answers) per round of
the loop, the rest waits for its next turn, so a flood on some connections delays the others by
little. A client that does not read its answers is held back (its requests are no longer read
until it drains them) and dropped when they pile up beyond a limit; a client that stays silent
for its session ttl loses its session. Its buffers count against the server's memory budget
(:class:`~rdzv.server._accounting.Accounting`), which sheds the largest holders.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, Union

from ..kv import protocol as P
from ._accounting import Accounting
from ._budget import TRACK_MIN
from ._dispatch import failed, resent
from ._greeting import Greeting
from ._loop import EPOLLIN, EPOLLOUT, readable
from ._wal_format import SessionRequest

if TYPE_CHECKING:
    from ._core import Core, Session
    from ._loop import Timer
    from ._waiters import Waiter

log = logging.getLogger("rdzv.server")
_monotonic = time.monotonic
_LEN_unpack_from = P.LEN.unpack_from
_HEAD_unpack_from = P.BODY_HEAD.unpack_from
_HEAD_SIZE = P.HEAD_SIZE
_READ_SIZE = 1 << 18

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to complete the handshake."""
CLOSE_TIMEOUT = 5.0
"""Seconds a closing connection has to take its last answers before it is cut."""
FRAMES_PER_TURN = 64
"""Requests of one connection handled per round of the loop (then the others have a turn)."""
_SEND_BUFFERS = 64
"""Answers handed to one ``sendmsg``, at most."""
TURN_BYTES = 1 << 20
"""... or fewer, once their answers in this round reach this many bytes."""


class Conn:
    """One client connection (see the module docstring)."""

    __slots__ = (
        "core", "sock", "fd", "peer", "greeting", "accounting", "session", "ttl", "max_frame",
        "last_recv", "chunks", "chunks_len", "need", "deferred", "dpos", "out", "out_size",
        "unsent", "unsent_size", "reading", "dirty", "waiters", "timer", "timer_due", "closed",
        "closing", "lingering", "read_at", "timed",
    )

    def __init__(self, core: "Core", sock: socket.socket, peer: str) -> None:
        self.core = core
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.greeting: Greeting | None = Greeting(self, core)
        """The handshake, until it is done (then None: the requests are served)."""
        self.accounting = Accounting(self, core.budget, core.shed)
        self.session: Session | None = None
        self.ttl = 0.0
        self.last_recv = _monotonic()
        self.chunks: list[bytes] | None = None
        """The start of a frame not yet read whole (``need`` bytes in all)."""
        self.chunks_len = 0
        self.need = 0
        self.deferred: bytes | None = None
        """Requests read but not handled yet (from ``dpos`` on): at its next turn, or once
        the client has taken its answers."""
        self.dpos = 0
        self.out: list[bytes] = []
        """Answers queued in this round, sent by :meth:`flush_out`."""
        self.out_size = 0
        self.unsent: deque[Union[bytes, memoryview]] = deque()
        """Answers the socket did not take yet, as they came (no copy; each freed once sent)."""
        self.unsent_size = 0
        self.reading = True
        self.dirty = False
        self.waiters: set[Waiter] = set()
        self.timer: Timer | None = None
        self.timer_due = 0.0
        self.closed = False
        self.closing = False
        self.lingering = False
        self.read_at = 0.0
        """When the first request answered in this round was read (for the latency histogram)."""
        self.timed = 0
        """Answers queued in this round to requests read in it (timed when sent)."""
        self.max_frame = P.HANDSHAKE_MAX_FRAME
        self.timer = core.loop.call_later(HANDSHAKE_TIMEOUT, self._handshake_timeout)

    # -- events -----------------------------------------------------------------------------------
    def on_event(self, events: int) -> None:
        if events & EPOLLOUT:
            self._send_unsent()
        if not self.reading or self.deferred is not None:
            # Held back, closing or closed, or the requests read wait for their turn.
            if self.lingering:
                self._discard()
            return
        try:
            n = self.sock.recv_into(self.core.rbuf, _READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.lost(exc)
            return
        if n == 0:
            self.lost(None)
            return
        self.received(self.core.rview[:n].tobytes())
        self.last_recv = _monotonic()  # (after the answers: not on the way to them)

    def received(self, data: bytes, pos: int = 0) -> None:
        """Handle the bytes ``data[pos:]`` read from the client: the whole frames in them, up
        to this connection's turn (the rest waits for the next one).

        The hot path of the server: the requests are decoded and answered inline here.
        """
        chunks = self.chunks
        if chunks is not None:
            chunks.append(data)
            self.chunks_len += len(data)
            if self.chunks_len < self.need:
                return
            data = b"".join(chunks)
            self.chunks = None
        core = self.core
        handlers = core.handlers
        mutating = core.mutating
        counts = core.metrics.requests
        out = self.out
        before = len(out)
        read_at = _monotonic()
        size = len(data)
        turn = FRAMES_PER_TURN
        try:
            while size - pos >= 4:
                (length,) = _LEN_unpack_from(data, pos)
                if length > self.max_frame:
                    self._oversized(length)
                    break
                end = pos + 4 + length
                if end > size:
                    self.chunks = [data[pos:]]
                    self.chunks_len = size - pos
                    self.need = 4 + length
                    break
                if self.greeting is not None:
                    self.greeting.step(data[pos + 4 : end])
                elif length < _HEAD_SIZE:
                    raise P.ProtocolError(f"request frame of {length} bytes is shorter than its header")
                else:
                    op, rid = _HEAD_unpack_from(data, pos + 4)
                    counts[op] += 1
                    sess = self.session
                    if not mutating[op]:
                        try:
                            resp = handlers[op](self, rid, data, pos + 9, end)
                        except Exception as exc:  # noqa: BLE001 - answered, never fatal
                            resp = failed(op, rid, exc, self.peer)
                    elif rid > sess.last_rid:  # type: ignore[union-attr]
                        try:
                            resp = handlers[op](self, rid, data, pos + 9, end)
                        except Exception as exc:  # noqa: BLE001 - answered, never fatal
                            resp = failed(op, rid, exc, self.peer)
                        sess.last_rid = rid  # type: ignore[union-attr]
                        sess.last_resp = resp  # type: ignore[union-attr]
                        if core.wal is not None:  # logged after the write's own effects
                            effects: list = core.state.effects  # type: ignore[assignment]
                            effects.append(SessionRequest(sess.id, rid, resp))  # type: ignore[union-attr]
                    else:
                        resp = resent(sess, op, rid)  # type: ignore[arg-type]
                    if resp is not None:
                        out.append(resp)
                        self.out_size += len(resp)
                pos = end
                turn -= 1
                if pos < size and (not turn or self.out_size > TURN_BYTES or not self.reading):
                    if self.closing or self.closed:
                        break
                    self.deferred = data  # the rest: at its next turn, or once it read its answers
                    self.dpos = pos
                    if self.reading:
                        core.loop.call_soon(self._resume_deferred)
                    break
            else:
                if pos < size:  # fewer than 4 bytes of the next frame
                    self.chunks = [data[pos:]]
                    self.chunks_len = size - pos
                    self.need = 4
        except P.ProtocolError as exc:
            self.drop(f"protocol error: {exc}", P.error(0, exc.code, str(exc)))
        if self.chunks is not None or self.deferred is not None or self.accounting.held:
            self.accounting.account()
        if self.out:
            if out is self.out and len(out) > before:
                if not self.timed:
                    self.read_at = read_at
                self.timed += len(out) - before
            if core.wal is None:
                self.flush_out()  # nothing to log first: answer at once
            elif not self.dirty:
                self.dirty = True
                core.dirty.append(self)

    def _oversized(self, length: int) -> None:
        msg = f"frame of {length} bytes exceeds the maximum frame size of {self.max_frame} bytes"
        if self.greeting is not None:
            self.drop(f"bad handshake ({msg}; not an rdzv client?)")
        else:
            self.drop(msg, P.error(0, P.E_FRAME_TOO_LARGE, msg))

    # -- answers ----------------------------------------------------------------------------------
    def queue(self, frame: bytes) -> None:
        """Queue a response to be sent at the end of this round (woken waiters, timeouts)."""
        if self.closed:
            return
        if not self.dirty:
            self.dirty = True
            self.core.dirty.append(self)
        self.out.append(frame)
        self.out_size += len(frame)

    def flush_out(self) -> None:
        """Send the answers queued in this round (what the socket does not take is kept)."""
        self.dirty = False
        self.out_size = 0
        if self.timed:
            self.core.metrics.request_latency.observe(_monotonic() - self.read_at, self.timed)
            self.timed = 0
        out = self.out
        if not out or self.closed:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()  # (the same list: received() may be appending to it)
        if self.unsent:
            self.unsent.append(data)
            self.unsent_size += len(data)
        else:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.lost(exc)
                return
            if sent == len(data):
                if self.closing:
                    self._linger()
                elif not self.reading:
                    self._resume_reading()
                return
            self.unsent.append(memoryview(data)[sent:])
            self.unsent_size = len(data) - sent
            self._watch_events()
        unsent = self.unsent_size
        if unsent > self.core.out_limit:
            self.drop(f"it does not read its responses ({unsent} bytes waiting to be sent)")
            return
        if unsent > self.core.out_high and self.reading:
            self.reading = False  # answers pile up: read on once the client has taken them
            self._watch_events()
        if unsent >= TRACK_MIN or self.accounting.held:
            self.accounting.account()

    def _send_unsent(self) -> None:
        unsent = self.unsent
        try:
            if len(unsent) == 1:
                sent = self.sock.send(unsent[0])
            else:
                sent = self.sock.sendmsg(list(islice(unsent, _SEND_BUFFERS)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.lost(exc)
            return
        self.unsent_size -= sent
        while sent:
            first = unsent[0]
            if sent < len(first):
                unsent[0] = memoryview(first)[sent:]
                break
            sent -= len(first)
            unsent.popleft()
        if self.accounting.held:
            self.accounting.account()
        if unsent:
            return
        if self.closing:
            self._linger()
            return
        # The client drained our answers: it is alive even if its requests wait unread (a
        # stopped process reads nothing), so its ttl counts from here.
        self.last_recv = _monotonic()
        if not self.reading:
            self._resume_reading()
        else:
            self._watch_events()

    def buffered(self) -> int:
        """Bytes of answers waiting to be sent to this client."""
        return self.unsent_size + self.out_size

    def _resume_reading(self) -> None:
        """Every answer went out: read this client's requests again, the deferred ones first."""
        if self.closing or self.closed:
            return
        self.reading = True
        self._watch_events()
        if self.deferred is not None:
            self.core.loop.call_soon(self._resume_deferred)

    def _resume_deferred(self) -> None:
        """This connection's next turn: go on with the requests read but not handled yet."""
        data = self.deferred
        if data is None or self.closed or not self.reading:
            return
        self.deferred = None
        self.received(data, self.dpos)

    def _watch_events(self) -> None:
        if self.closed:
            return
        events = (EPOLLIN if self.reading or self.lingering else 0) | (
            EPOLLOUT if self.unsent else 0
        )
        self.core.loop.modify(self.fd, events)

    # -- closing ----------------------------------------------------------------------------------
    def drop(self, why: str, last_frame: bytes | None = None) -> None:
        """Close this connection (after ``last_frame``, if given), logging why."""
        if self.closed:
            return
        log.warning("dropping the connection from %s: %s", self.peer, why)
        self.out = []
        if last_frame is None:
            self.lost(None)
            return
        self.queue(last_frame)
        self.finish()
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.core.loop.call_later(CLOSE_TIMEOUT, self.close_now)

    def finish(self) -> None:
        """Read no more requests; close once the answers queued so far are sent."""
        self.closing = True
        self.reading = False

    def _linger(self) -> None:
        """The last answers are sent: end this side, and discard what the client still sends
        until it closes (at most ``CLOSE_TIMEOUT``): closing with its bytes
        unread would reset the connection, and the client might lose those last answers."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.lost(None)
            return
        self.lingering = True
        self._watch_events()
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.core.loop.call_later(CLOSE_TIMEOUT, self.close_now)

    def _discard(self) -> None:
        try:
            n = self.sock.recv_into(self.core.rbuf, _READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:
            self.lost(None)

    def close_now(self) -> None:
        """Close the socket at once (the answers sent so far stay sent)."""
        self.lost(None)

    def lost(self, exc: BaseException | None) -> None:
        """The connection ended (closed by either side, or broken)."""
        if self.closed:
            return
        self.closed = True
        self.reading = False
        if exc is not None:
            log.debug("connection from %s broke: %s", self.peer, exc)
        core = self.core
        core.loop.unregister(self.fd)
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass
        core.conns.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for w in list(self.waiters):
            core.waiters.remove(w)
        self.out = []
        self.unsent = deque()
        self.unsent_size = 0
        self.deferred = None
        self.chunks = None
        self.accounting.release()
        sess = self.session
        self.session = None
        if sess is not None and sess.conn is self and not core.stopping and core.failed is None:
            log.debug("connection from %s closed; ending its session %d", self.peer, sess.id)
            core.end_session(sess)

    def shed(self, why: str) -> None:
        """Drop this connection to keep the server in its memory budget, freeing its buffers.

        Its session is kept for a ttl, for the client to resume; a request it was sending is
        answered with the error (and not applied), the requests after it are not read."""
        self.accounting.release()
        sess = self.session
        if sess is not None and sess.conn is self:
            self.session = None
            self.core.detach_session(sess, _monotonic())
        rid = 0
        chunks = self.chunks
        if chunks is not None and self.chunks_len >= 4 + _HEAD_SIZE and len(chunks[0]) >= 9:
            rid = _HEAD_unpack_from(chunks[0], 4)[1]  # (assembled below 9 bytes: unnamed)
        self.chunks = None
        self.deferred = None
        if self.unsent or self.closing:  # in the middle of its answers: no error can follow
            log.warning("dropping the connection from %s: %s", self.peer, why)
            self.lost(None)
        else:
            self.drop(why, P.error(rid, P.E_BUSY, why))

    # -- the handshake and the session's ttl ------------------------------------------------------
    def greeted(self, sess: "Session", ttl: float) -> None:
        """The handshake is done: serve the requests of session ``sess``, silent for ``ttl``
        seconds at most (0: no limit)."""
        self.session = sess
        self.ttl = ttl
        self.greeting = None
        self.max_frame = self.core.max_frame_size
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if ttl > 0:
            self._arm_ttl(self.last_recv + ttl)

    def _handshake_timeout(self) -> None:
        self.timer = None
        if self.greeting is not None:
            self.drop(f"no handshake within {HANDSHAKE_TIMEOUT:g} s")

    def _arm_ttl(self, when: float) -> None:
        self.timer_due = when
        self.timer = self.core.loop.call_at(when, self._ttl_check)

    def _ttl_check(self) -> None:
        self.timer = None
        if self.closed:
            return
        now = _monotonic()
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
        if readable(self.fd) and self.reading and self.deferred is None:
            self._arm_ttl(now + 0.05)  # its frames arrived but are not read yet
            return
        sess = self.session
        log.warning(
            "client %s sent nothing for %g s (its session ttl): ending session %s",
            self.peer,
            self.ttl,
            sess.id if sess else "-",
        )
        if sess is not None:
            self.core.metrics.sessions_expired += 1
        self.drop("session ttl expired")
