"""StoreServer: the store served over TCP by an asyncio event loop (Protocol/Transport API).

One thread runs the loop; the data lives in a :class:`~rdzv.store._state.KVState`. Every request
is answered from memory without blocking the loop. Blocking reads (get, wait, multi_get) and
watches that cannot be answered at once become *waiters*, registered under the paths they care
about and answered the moment a write touches one of them (or when their wait runs out).

Each connection carries a *session*: a client's ephemeral keys live as long as it. A session
ends when its connection closes, when no frame arrives on it for its ttl, or when the client says
so (``close_session``). With ``data_dir`` every change is written ahead to a log before any
response that depends on it is sent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import struct
import threading
import time
from typing import Any, Callable

from ..errors import StoreError, StoreValueError
from ..store._base import DEFAULT_SESSION_TTL, dir_paths
from ..store._state import KVState
from . import _auth
from . import protocol as P

log = logging.getLogger("rdzv.server")
_DEC = P.DECODERS
_dec_set = _DEC[P.OP_SET]
_dec_get = _DEC[P.OP_GET]
_ok = P.ok
_monotonic = time.monotonic
_LEN_unpack_from = P.LEN.unpack_from
_HEAD_unpack_from = P.BODY_HEAD.unpack_from

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to complete the handshake."""
LISTEN_BACKLOG = 4096
_READY = 2
_AUTH = 1
_HELLO = 0


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (thousands of clients); the new soft limit."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    except (ValueError, OSError) as exc:
        log.debug("could not raise RLIMIT_NOFILE from %s to %s: %s", soft, target, exc)
        return soft


def _listen_socket(host: str | None, port: int) -> socket.socket:
    """A bound socket for ``host:port`` (one address only, so that port 0 means one port)."""
    bind_host = host or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(bind_host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {bind_host}:{port}: {exc}") from None
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and bind_host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {bind_host}:{port}: {exc.strerror}") from None
    return sock


class _Session:
    __slots__ = ("id", "ttl", "conn", "last_rid", "last_resp", "timer")

    def __init__(self, sid: int, ttl: float) -> None:
        self.id = sid
        self.ttl = ttl
        self.conn: _Conn | None = None
        self.last_rid = 0
        self.last_resp: bytes | None = b""
        self.timer: asyncio.TimerHandle | None = None


class _Waiter:
    """A request waiting for keys to appear (get/wait/multi_get) or a path to change (watch)."""

    __slots__ = ("conn", "rid", "op", "keys", "since", "timer", "done")

    def __init__(self, conn: "_Conn", rid: int, op: int, keys: list[str], since: int) -> None:
        self.conn = conn
        self.rid = rid
        self.op = op
        self.keys = keys  # the keys awaited, or [path] for a watch
        self.since = since
        self.timer: asyncio.TimerHandle | None = None
        self.done = False


class _Core:
    """Everything that runs on the loop: data, sessions, waiters, connections, the log."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        state: KVState,
        wal: Any,
        secret: bytes | None,
        max_frame_size: int,
    ) -> None:
        self.loop = loop
        self.state = state
        self.wal = wal
        self.secret = secret
        self.max_frame_size = max_frame_size
        self.out_high = max_frame_size + (1 << 20)
        """Write buffer high-water mark of a connection (asyncio then pauses its reading)."""
        self.out_limit = 2 * self.out_high
        """A connection whose unsent answers exceed this is dropped (it does not read them)."""
        self.rview = memoryview(bytearray(1 << 18))  # every connection reads into this
        self.conns: set[_Conn] = set()
        self.sessions: dict[int, _Session] = {}
        self.waiters: dict[str, set[_Waiter]] = {}
        self.dirty: list[_Conn] = []
        self.commit_scheduled = False
        self.stopping = False
        self.failed: BaseException | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None
        h: list[Callable[..., bytes | None]] = [self._op_unknown] * 256
        h[P.OP_PING] = self._op_ping
        h[P.OP_SET] = self._op_set
        h[P.OP_GET] = self._op_get
        h[P.OP_ADD] = self._op_add
        h[P.OP_COMPARE_SET] = self._op_compare_set
        h[P.OP_WAIT] = self._op_wait
        h[P.OP_CHECK] = self._op_check
        h[P.OP_DELETE] = self._op_delete
        h[P.OP_NUM_KEYS] = self._op_num_keys
        h[P.OP_MULTI_GET] = self._op_multi_get
        h[P.OP_MULTI_SET] = self._op_multi_set
        h[P.OP_APPEND] = self._op_append
        h[P.OP_LIST_KEYS] = self._op_list_keys
        h[P.OP_COUNT_KEYS] = self._op_count_keys
        h[P.OP_REVISION] = self._op_revision
        h[P.OP_WATCH] = self._op_watch
        h[P.OP_CLOSE_SESSION] = self._op_close_session
        self.handlers = h
        self.mutating = [op in P.MUTATING_OPS for op in range(256)]
        now = loop.time()
        for sid, ttl in list(state.session_ttls.items()):
            # Recovered from the log: each session gets a fresh window to be resumed.
            sess = _Session(sid, ttl)
            self.sessions[sid] = sess
            window = ttl if ttl > 0 else DEFAULT_SESSION_TTL
            sess.timer = loop.call_at(now + window, self._expire_detached, sess)

    # -- committing: log first, then answer ------------------------------------------------
    def commit(self) -> None:
        """Make the pending effects durable, then send every pending response."""
        self.commit_scheduled = False
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
                wal.snapshot_if_due(self.state)
            except Exception:  # a failed snapshot leaves the log intact
                log.exception("writing a snapshot of the store failed; the log is kept")

    def request_commit(self) -> None:
        """Commit now (in memory), or at the end of this loop iteration (group commit to the log)."""
        if self.wal is None:
            self.commit()
        elif not self.commit_scheduled:
            self.commit_scheduled = True
            self.loop.call_soon(self.commit)

    def fatal(self, exc: BaseException) -> None:
        """The write-ahead log failed: acknowledge nothing more, drop every client, stop."""
        if self.failed is not None:
            return
        self.failed = exc
        log.critical("the write-ahead log failed (%s); stopping the store server", exc)
        self.dirty = []
        for conn in list(self.conns):
            conn.out = []
            conn.transport.abort()
        if self.on_fatal is not None:
            self.on_fatal(exc)

    # -- sessions --------------------------------------------------------------------------------
    def attach_session(self, conn: "_Conn", hello: P.Hello) -> tuple[_Session, bool]:
        sess = self.sessions.get(hello.resume_session) if hello.resume_session else None
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
            sess = _Session(self.state.open_session(hello.ttl), hello.ttl)
            self.sessions[sess.id] = sess
            resumed = False
        sess.conn = conn
        return sess, resumed

    def end_session(self, sess: _Session) -> None:
        """Close ``sess``: delete its ephemeral keys and wake whoever watches them."""
        if self.sessions.pop(sess.id, None) is None:
            return
        if sess.timer is not None:
            sess.timer.cancel()
            sess.timer = None
        sess.conn = None
        changed = self.state.close_session(sess.id)
        if changed and self.waiters:
            self.wake(changed)

    def _expire_detached(self, sess: _Session) -> None:
        sess.timer = None
        if sess.conn is None and sess.id in self.sessions:
            log.info("session %d was not resumed after the restart; it expires", sess.id)
            self.end_session(sess)
            self.request_commit()

    # -- waiters ----------------------------------------------------------------------------------
    def add_waiter(self, w: _Waiter, wait_ms: int) -> None:
        reg = self.waiters
        for path in w.keys:
            ws = reg.get(path)
            if ws is None:
                reg[path] = {w}
            else:
                ws.add(w)
        w.conn.waiters.add(w)
        w.timer = self.loop.call_later(wait_ms / 1000.0, self._waiter_timeout, w)

    def remove_waiter(self, w: _Waiter) -> None:
        w.done = True
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        reg = self.waiters
        for path in w.keys:
            ws = reg.get(path)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del reg[path]
        w.conn.waiters.discard(w)

    def wake(self, changed: list[str]) -> None:
        """Answer the waiters that a change of the keys ``changed`` satisfies."""
        reg = self.waiters
        hit: list[_Waiter] = []
        for key in changed:
            for path in dir_paths(key):
                ws = reg.get(path)
                if ws:
                    hit.extend(ws)
        for w in hit:
            if not w.done:
                resp = self._answer(w)
                if resp is not None:
                    self.remove_waiter(w)
                    w.conn.queue(resp)

    def _answer(self, w: _Waiter) -> bytes | None:
        """The response for ``w`` if it can be answered now, else None."""
        state = self.state
        op = w.op
        if op == P.OP_WATCH:
            rev = state.path_revision(w.keys[0])
            return P.ok(w.rid, P.U64.pack(rev)) if rev > w.since else None
        if op == P.OP_GET:
            value = state.get(w.keys[0])
            return None if value is None else P.ok(w.rid, value)
        values = [state.get(k) for k in w.keys]
        if None in values:
            return None
        if op == P.OP_WAIT:
            return P.ok(w.rid)
        return P.ok(w.rid, P.payload_values(values))  # type: ignore[arg-type]

    def _waiter_timeout(self, w: _Waiter) -> None:
        w.timer = None
        if w.done:
            return
        self.remove_waiter(w)
        if w.op == P.OP_WATCH:
            resp = P.ok(w.rid, P.U64.pack(self.state.path_revision(w.keys[0])))
        else:
            state = self.state
            resp = P.timeout(w.rid, [k for k in w.keys if not state.contains(k)])
        w.conn.queue(resp)
        self.request_commit()

    # -- request handlers: (conn, rid, buf, pos, end) -> response frame, or None if deferred ----
    def _op_unknown(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        raise P.ProtocolError(f"unknown opcode {buf[pos - P.HEAD_SIZE]}", P.E_UNKNOWN_OP)

    def _op_ping(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        return P.ok(rid)

    def _op_set(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        key, value, ephemeral = _dec_set(buf, pos, end)
        changed = self.state.set(key, value, conn.session.id if ephemeral else 0)  # type: ignore[union-attr]
        if self.waiters:
            self.wake(changed)
        return None if buf[pos] & P.FLAG_QUIET else _ok(rid)

    def _op_get(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        key, blocking, wait_ms = _dec_get(buf, pos, end)
        value = self.state.get(key)
        if value is not None:
            return _ok(rid, value) if blocking else _ok(rid, P.FOUND + value)
        if not blocking:
            return P.ok(rid, P.NOT_FOUND)
        if wait_ms == 0:
            return P.timeout(rid, [key])
        self.add_waiter(_Waiter(conn, rid, P.OP_GET, [key], 0), wait_ms)
        return None

    def _op_add(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        key, amount = _DEC[P.OP_ADD](buf, pos, end)
        result, changed = self.state.add(key, amount)
        if self.waiters:
            self.wake(changed)
        return P.ok(rid, str(result).encode())

    def _op_compare_set(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        key, expected, desired, ephemeral = _DEC[P.OP_COMPARE_SET](buf, pos, end)
        result, changed = self.state.compare_set(
            key, expected, desired, conn.session.id if ephemeral else 0  # type: ignore[union-attr]
        )
        if changed and self.waiters:
            self.wake(changed)
        return P.ok(rid, result)

    def _blocking_keys(self, conn: "_Conn", rid: int, op: int, keys: list[str], wait_ms: int) -> bytes | None:
        w = _Waiter(conn, rid, op, keys, 0)
        resp = self._answer(w)
        if resp is not None:
            return resp
        if wait_ms == 0:
            state = self.state
            return P.timeout(rid, [k for k in keys if not state.contains(k)])
        self.add_waiter(w, wait_ms)
        return None

    def _op_wait(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        keys, wait_ms = _DEC[P.OP_WAIT](buf, pos, end)
        return self._blocking_keys(conn, rid, P.OP_WAIT, keys, wait_ms)

    def _op_multi_get(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        keys, wait_ms = _DEC[P.OP_MULTI_GET](buf, pos, end)
        return self._blocking_keys(conn, rid, P.OP_MULTI_GET, keys, wait_ms)

    def _op_check(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (keys,) = _DEC[P.OP_CHECK](buf, pos, end)
        contains = self.state.contains
        return P.ok(rid, P.TRUE if all(contains(k) for k in keys) else P.FALSE)

    def _op_delete(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (key,) = _DEC[P.OP_DELETE](buf, pos, end)
        changed = self.state.delete(key)
        if changed and self.waiters:
            self.wake(changed)
        return P.ok(rid, P.TRUE if changed else P.FALSE)

    def _op_num_keys(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        _DEC[P.OP_NUM_KEYS](buf, pos, end)
        return P.ok(rid, P.U64.pack(self.state.num_keys()))

    def _op_multi_set(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        keys, values = _DEC[P.OP_MULTI_SET](buf, pos, end)
        if keys:
            changed = self.state.multi_set(keys, values)
            if self.waiters:
                self.wake(changed)
        return P.ok(rid)

    def _op_append(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        key, value = _DEC[P.OP_APPEND](buf, pos, end)
        changed = self.state.append(key, value)
        if self.waiters:
            self.wake(changed)
        return P.ok(rid)

    def _op_list_keys(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (prefix,) = _DEC[P.OP_LIST_KEYS](buf, pos, end)
        payload = P.payload_items(self.state.list_keys(prefix))
        if len(payload) + P.HEAD_SIZE > self.max_frame_size:
            raise StoreValueError(
                f"list_keys({prefix!r}) would answer {len(payload)} bytes, more than the "
                f"maximum frame size {self.max_frame_size}"
            )
        return P.ok(rid, payload)

    def _op_count_keys(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (prefix,) = _DEC[P.OP_COUNT_KEYS](buf, pos, end)
        return P.ok(rid, P.U64.pack(self.state.count_keys(prefix)))

    def _op_revision(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (path,) = _DEC[P.OP_REVISION](buf, pos, end)
        return P.ok(rid, P.U64.pack(self.state.path_revision(path)))

    def _op_watch(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        path, since, wait_ms = _DEC[P.OP_WATCH](buf, pos, end)
        rev = self.state.path_revision(path)
        if rev > since or wait_ms == 0:
            return P.ok(rid, P.U64.pack(rev))
        self.add_waiter(_Waiter(conn, rid, P.OP_WATCH, [path], since), wait_ms)
        return None

    def _op_close_session(self, conn: "_Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        _DEC[P.OP_CLOSE_SESSION](buf, pos, end)
        sess = conn.session
        if sess is not None:
            conn.session = None
            self.end_session(sess)
        conn.closing = True
        return P.ok(rid)


class _Conn(asyncio.BufferedProtocol):
    """One client connection: framing, handshake, then requests dispatched to the core.

    A BufferedProtocol: the loop reads into one buffer shared by all connections (asyncio's
    plain Protocol allocates a fresh 256 KiB object per read, which costs more than the request).
    """

    def __init__(self, core: _Core) -> None:
        self.core = core
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.peer = "?"
        self.phase = _HELLO
        self.session: _Session | None = None
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
        self.waiters: set[_Waiter] = set()
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


class StoreServer:
    """The rdzv store served over TCP.

    ``StoreServer(host, port).start()`` serves from a background thread of this process and
    returns once listening (port 0 picks a free port: see :attr:`port`); ``serve_forever()``
    serves in the calling thread until SIGINT/SIGTERM or :meth:`stop`. With ``data_dir`` every
    acknowledged write survives a crash of the server (``fsync="always"``) or of its process
    (``fsync="never"``).
    """

    def __init__(
        self,
        host: str | None = "127.0.0.1",
        port: int = 0,
        *,
        secret: _auth.Secret = None,
        data_dir: str | os.PathLike | None = None,
        fsync: str = "always",
        max_frame_size: int = P.DEFAULT_MAX_FRAME_SIZE,
        sock: socket.socket | None = None,
    ) -> None:
        if fsync not in ("always", "never"):
            raise ValueError(f"fsync must be 'always' or 'never', not {fsync!r}")
        if not 1024 <= max_frame_size <= 0xFFFFFFFF:
            raise ValueError(f"max_frame_size must be between 1 KiB and 4 GiB, not {max_frame_size}")
        self.host = host
        self._port = port
        self._secret = _auth.normalize_secret(secret)
        self._data_dir = data_dir
        self._fsync = fsync
        self._max_frame_size = max_frame_size
        self._sock = sock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._core: _Core | None = None
        self._wal: Any = None
        self._thread: threading.Thread | None = None
        self._address: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._started = False

    # -- public ----------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port listened on (the one picked, if created with port 0)."""
        if self._address is None:
            raise StoreError("the store server is not started")
        return self._address[1]

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) listened on."""
        if self._address is None:
            raise StoreError("the store server is not started")
        return self._address

    @property
    def failed(self) -> BaseException | None:
        """The error that stopped the server (a write-ahead log failure), if any."""
        return self._core.failed if self._core is not None else None

    def start(self) -> "StoreServer":
        """Serve from a background thread; returns once the server is listening."""
        with self._lock:
            if self._started:
                raise StoreError("the store server was already started")
            self._started = True
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self._open(loop))
            except BaseException as exc:  # noqa: BLE001 - reported to start()'s caller
                errors.append(exc)
                self._cleanup(loop)
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                self._cleanup(loop)

        self._thread = threading.Thread(target=run, name="rdzv-store-server", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            self._thread.join()
            raise errors[0]
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM (when in the main thread) or stop()."""
        with self._lock:
            if self._started:
                raise StoreError("the store server was already started")
            self._started = True
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._open(loop))
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, self._on_signal, sig)
            loop.run_forever()
        finally:
            self._cleanup(loop)
        if self._core is not None and self._core.failed is not None:
            raise StoreError(f"the store server stopped: {self._core.failed}") from self._core.failed

    def stop(self) -> None:
        """Stop serving: close the listener and every connection (sessions are kept in the log)."""
        loop = self._loop
        if loop is None:
            return
        if not self._stopped.is_set():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # the loop is already closed
                pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> "StoreServer":
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"{self._address[0]}:{self._address[1]}" if self._address else "not started"
        return f"StoreServer({where})"

    # -- internals --------------------------------------------------------------------------------
    def _on_signal(self, sig: int) -> None:
        log.info("received %s; stopping the store server", signal.Signals(sig).name)
        assert self._loop is not None
        self._loop.stop()

    async def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        raise_nofile_limit()
        state = KVState()
        if self._data_dir is not None:
            from ._wal import WriteAheadLog

            self._wal = WriteAheadLog(self._data_dir, fsync=self._fsync)
            state = self._wal.recover()
            state.effects = []
        sock = self._sock if self._sock is not None else _listen_socket(self.host, self._port)
        core = _Core(loop, state, self._wal, self._secret, self._max_frame_size)
        core.on_fatal = lambda exc: loop.stop()
        self._core = core
        self._server = await loop.create_server(
            lambda: _Conn(core), sock=sock, backlog=LISTEN_BACKLOG
        )
        name = sock.getsockname()
        self._address = (name[0], name[1])
        log.info(
            "rdzv store server listening on %s:%d (%s, %s)",
            name[0],
            name[1],
            f"data in {os.fspath(self._data_dir)}, fsync={self._fsync}"
            if self._data_dir is not None
            else "in memory",
            "shared-secret auth" if self._secret else "no auth",
        )
        if state.session_ttls:
            log.info("recovered %d session(s); awaiting their clients", len(state.session_ttls))

    def _cleanup(self, loop: asyncio.AbstractEventLoop) -> None:
        core = self._core
        try:
            if core is not None:
                core.stopping = True
                if core.failed is None and core.wal is not None:
                    core.commit()  # flush whatever was logged but not yet acknowledged
            if self._server is not None:
                self._server.close()
            if core is not None:
                for conn in list(core.conns):
                    conn.transport.abort()
                for sess in core.sessions.values():
                    if sess.timer is not None:
                        sess.timer.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            if self._server is not None:
                loop.run_until_complete(self._server.wait_closed())
        except Exception:  # pragma: no cover - best effort on the way out
            log.exception("error while stopping the store server")
        finally:
            if self._wal is not None:
                try:
                    self._wal.close()
                except Exception:  # pragma: no cover
                    log.exception("error closing the write-ahead log")
                self._wal = None
            loop.close()
            self._stopped.set()

