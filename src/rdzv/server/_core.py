"""The server's state on the event loop: data, sessions and their expiry, committing.

:class:`Core` owns the :class:`~rdzv.kv.KVState`, the sessions (attached to
connections, expired when not resumed after a restart) and the commit step that runs at the end
of every round of the loop: it makes the round's changes durable in the write-ahead log (one
flush for all of them), then sends every connection's answers (one send each). It has the
waiters (:mod:`._waiters`) and the table of request handlers (:mod:`._dispatch`): with them and
its connections (:mod:`._conn`) it is everything that runs on the loop.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
from typing import Any, Callable

from ..kv import DEFAULT_SESSION_TTL, KVState, protocol as P
from ._budget import MemoryBudget, return_freed_memory
from ._conn import Conn
from ._dispatch import RequestHandlers
from ._loop import EPOLLIN, EventLoop, Timer
from ._metrics import ServerMetrics, ServerMetricsSnapshot
from ._wal_format import SessionRequest
from ._waiters import Waiters

log = logging.getLogger("rdzv.server")


class Session:
    """A client's session: its ephemeral keys' owner, and the last write it had applied."""

    __slots__ = ("id", "ttl", "token", "conn", "last_rid", "last_resp", "timer")

    def __init__(self, sid: int, ttl: float, token: bytes) -> None:
        self.id = sid
        self.ttl = ttl
        self.token = token
        """The secret its owner resumes it with (empty: recovered without one, not resumable)."""
        self.conn: Conn | None = None
        self.last_rid = 0
        self.last_resp: bytes | None = b""
        self.timer: Timer | None = None


class Core:
    """Everything that runs on the loop: data, sessions, waiters, connections, the log."""

    def __init__(
        self,
        loop: EventLoop,
        state: KVState,
        wal: Any,
        secret: bytes | None,
        max_frame_size: int,
        memory_budget: int,
        memory_base: int = 0,
    ) -> None:
        self.loop = loop
        self.state = state
        self.wal = wal
        self.secret = secret
        self.max_frame_size = max_frame_size
        self.out_high = max_frame_size + (1 << 20)
        """Answers pending to a connection beyond which its requests are no longer read."""
        self.out_limit = 2 * self.out_high
        """A connection whose unsent answers exceed this is dropped (it does not read them)."""
        self.budget: MemoryBudget[Conn] = MemoryBudget(memory_budget, memory_base)
        if self.budget.for_buffers < self.out_high:
            raise ValueError(
                f"a memory budget of {_mib(memory_budget)} leaves {_mib(self.budget.for_buffers)} "
                f"for client buffers (a quarter is kept in reserve, the server itself takes "
                f"{_mib(self.budget.base)}): not "
                f"enough for one request of the maximum frame size ({_mib(max_frame_size)}) and "
                "its answers; raise the memory budget or lower the maximum frame size"
            )
        self.rbuf = bytearray(1 << 18)  # every connection reads into this
        self.rview = memoryview(self.rbuf)
        self.conns: set[Conn] = set()
        self.sessions: dict[int, Session] = {}
        self.waiters = Waiters(loop, state, send_at_once=wal is None)
        self.dirty: list[Conn] = []
        self.stopping = False
        self.failed: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.metrics = ServerMetrics()
        self.handlers = RequestHandlers(
            state, self.waiters, self.end_session, max_frame_size
        ).table()
        """The handler of each opcode."""
        self.mutating = [op in P.MUTATING_OPS for op in range(256)]
        loop.after_round = self.commit
        now = loop.time()
        for sid, ttl in list(state.session_ttls.items()):
            # Recovered from the log: each session gets a fresh window to be resumed.
            sess = Session(sid, ttl, state.session_tokens.get(sid, b""))
            last = wal.requests.get(sid) if wal is not None else None
            if last is not None:  # its last write: a resent copy is answered, not applied
                sess.last_rid, sess.last_resp = last.rid, last.answer
            self.sessions[sid] = sess
            self.detach_session(sess, now)

    # -- connections ------------------------------------------------------------------------------
    def accept(self, sock: socket.socket, peer: str) -> None:
        """Serve the new connection ``sock``."""
        if self.stopping or self.failed is not None:
            sock.close()
            return
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # pragma: no cover - not TCP (a Unix socket handed over)
            pass
        conn = Conn(self, sock, peer)
        self.metrics.connections_accepted += 1
        self.conns.add(conn)
        self.loop.register(conn.fd, EPOLLIN, conn)

    # -- the memory budget -----------------------------------------------------------------------
    def shed(self, victims: list[Conn]) -> None:
        """Drop ``victims``, the largest holders of buffers, to stay within the memory budget."""
        stats = self.stats()
        numbers = (
            f"{_mib(stats['buffered_bytes'])} buffered for {len(self.budget.held)} connection(s) "
            f"(input {_mib(stats['buffered_input_bytes'])}, output "
            f"{_mib(stats['buffered_output_bytes'])}), {_mib(self.budget.for_buffers)} allowed "
            f"(--memory-budget {_mib(self.budget.limit)} less a quarter and the server's own "
            f"{_mib(self.budget.base)})"
        )
        for conn in victims:
            self.budget.shed += 1
            why = (
                f"the store server is over its memory budget ({numbers}) and this connection "
                f"holds the most: {conn.accounting.holds()}; retry later, or raise the server's "
                "--memory-budget"
            )
            conn.shed(why)
        return_freed_memory()

    def stats(self) -> dict[str, int]:
        """The server's numbers: connections, sessions, keys, and the memory budget's."""
        budget = self.budget
        held = list(budget.held)  # (one C call: safe from another thread)
        output = sum(conn.unsent_size for conn in held)
        return {
            "connections": len(self.conns),
            "sessions": len(self.sessions),
            "keys": self.state.num_keys(),
            "memory_budget": budget.limit,
            "memory_base": budget.base,
            "buffered_bytes": budget.total,
            "buffered_input_bytes": max(0, budget.total - output),
            "buffered_output_bytes": output,
            "shed_connections": budget.shed,
        }

    def metrics_snapshot(self) -> ServerMetricsSnapshot:
        """The server's counters and histograms now, with :meth:`stats` (from any thread)."""
        return self.metrics.snapshot(self.stats(), self.wal)

    # -- committing: log first, then answer ------------------------------------------------
    def commit(self) -> None:
        """Make the pending effects durable, then send every pending response (the end of
        every round of the loop)."""
        wal = self.wal
        logged = False
        if wal is not None:
            effects = self.state.effects
            if effects:
                self.state.effects = []
                try:
                    wal.append(effects)
                    wal.flush()
                except BaseException as exc:  # noqa: BLE001 - nothing may be acknowledged now
                    self.fatal(exc)
                    return
                logged = True
        dirty = self.dirty
        if dirty:
            self.dirty = []
            for conn in dirty:
                conn.flush_out()
        if logged:
            try:
                wal.snapshot_if_due(self.state, self.last_requests)
            except Exception:  # a failed snapshot leaves the log intact
                log.exception("writing a snapshot of the store failed; the log is kept")

    def last_requests(self) -> dict[int, SessionRequest]:
        """The last write of each session that wrote (what a snapshot keeps)."""
        return {
            sid: SessionRequest(sid, sess.last_rid, sess.last_resp)
            for sid, sess in self.sessions.items()
            if sess.last_rid
        }

    def fatal(self, exc: BaseException) -> None:
        """The write-ahead log failed: acknowledge nothing more, drop every client, stop."""
        if self.failed is not None:
            return
        self.failed = exc
        log.critical("the write-ahead log failed (%s); stopping the store server", exc)
        self.dirty = []
        for conn in list(self.conns):
            conn.lost(None)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    # -- sessions --------------------------------------------------------------------------------
    def attach_session(self, conn: "Conn", hello: P.Hello) -> tuple[Session, bool]:
        """The session of a client that completed its handshake, and whether it was resumed.

        A session is resumed only with its token (compared in constant time); a client that
        names a session it cannot prove it owns gets a new one, and the owner keeps its own.
        """
        sess = self.sessions.get(hello.resume_session) if hello.resume_session else None
        if sess is not None and not (
            sess.token and hmac.compare_digest(sess.token, hello.resume_token)
        ):
            log.warning(
                "%s asked to resume session %d without its token; it gets a new session "
                "(the session stays with its owner)", conn.peer, sess.id,
            )
            sess = None
        if sess is not None:
            old = sess.conn
            if old is not None and old is not conn:
                old.session = None
                old.drop(f"its session {sess.id} was resumed by a new connection from {conn.peer}")
            if sess.timer is not None:
                sess.timer.cancel()
                sess.timer = None
            sess.ttl = hello.ttl
            resumed = True
        else:
            token = secrets.token_bytes(P.TOKEN_SIZE)
            sess = Session(self.state.open_session(hello.ttl, token), hello.ttl, token)
            self.sessions[sess.id] = sess
            resumed = False
        sess.conn = conn
        return sess, resumed

    def end_session(self, sess: Session) -> None:
        """Close ``sess``: delete its ephemeral keys and wake whoever watches them."""
        if self.sessions.pop(sess.id, None) is None:
            return
        if sess.timer is not None:
            sess.timer.cancel()
            sess.timer = None
        sess.conn = None
        changed = self.state.close_session(sess.id)
        if changed and self.waiters:
            self.waiters.wake(changed)

    def detach_session(self, sess: Session, now: float) -> None:
        """Keep ``sess`` without a connection for one ttl (15 s if 0) from ``now``, for its
        client to resume (after a restart of the server, or its connection shed)."""
        sess.conn = None
        window = sess.ttl if sess.ttl > 0 else DEFAULT_SESSION_TTL
        sess.timer = self.loop.call_at(now + window, self._expire_detached, sess)

    def _expire_detached(self, sess: Session) -> None:
        sess.timer = None
        if sess.conn is None and sess.id in self.sessions:
            log.info("session %d was not resumed by its client; it expires", sess.id)
            self.metrics.sessions_expired += 1
            self.end_session(sess)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
