"""Request dispatch: one handler per opcode, decoding the arguments and answering from the state.

A handler takes ``(conn, rid, buf, pos, end)`` (the request's arguments are ``buf[pos:end]``,
``conn`` the connection it came on, with its session) and returns the response frame, or None
when the answer comes later (a waiter) or not at all (a quiet SET). :class:`RequestHandlers`
holds what the handlers work on (the state, the waiters, the sessions' end) and builds the table
of the server's core; :func:`failed` and :func:`resent` answer the requests it does not handle.
"""

from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING, Callable

from ..errors import StoreValueError
from ..kv import KVState, protocol as P
from ._waiters import Waiter

if TYPE_CHECKING:
    from ._conn import Conn
    from ._core import Session
    from ._waiters import Waiters

log = logging.getLogger("rdzv.server")
_DEC = P.DECODERS
_dec_set = _DEC[P.OP_SET]
_dec_get = _DEC[P.OP_GET]
_ok = P.ok
_RESP_pack = P.RESP_HEAD.pack
_HEAD_SIZE = P.HEAD_SIZE
_OK = P.STATUS_OK
_QUIET = P.FLAG_QUIET

Handler = Callable[["Conn", int, bytes, int, int], "bytes | None"]


def unknown_op(conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
    """The handler of every opcode this server does not know."""
    raise P.ProtocolError(f"unknown opcode {buf[pos - P.HEAD_SIZE]}", P.E_UNKNOWN_OP)


def failed(op: int, rid: int, exc: Exception, peer: str) -> bytes:
    """The error answer to request ``rid`` from ``peer`` whose handler raised ``exc``."""
    if isinstance(exc, P.ProtocolError):
        log.warning("bad request from %s: %s", peer, exc)
        return P.error(rid, exc.code, str(exc))
    if isinstance(exc, (struct.error, UnicodeDecodeError)):
        msg = f"malformed {P.OP_NAMES.get(op, op)} request: {exc}"
        log.warning("bad request from %s: %s", peer, msg)
        return P.error(rid, P.E_BAD_REQUEST, msg)
    if isinstance(exc, StoreValueError):
        return P.error(rid, P.E_VALUE, str(exc))
    log.error("error answering a %s request from %s", P.OP_NAMES.get(op, op), peer, exc_info=exc)
    return P.error(rid, P.E_INTERNAL, f"{type(exc).__name__}: {exc}")


def resent(sess: "Session", op: int, rid: int) -> bytes | None:
    """The answer to a write of ``sess`` resent after a reconnect, which was applied already."""
    if rid == sess.last_rid:
        return sess.last_resp  # None: a quiet SET that succeeded
    if op in P.PIPELINED_OPS:
        return P.ok(rid)  # an earlier pipelined write: its answer was "done"
    return P.error(
        rid,
        P.E_BAD_REQUEST,
        f"{P.OP_NAMES[op]} request {rid} was applied already (the last write of session "
        f"{sess.id} is request {sess.last_rid}); request ids must grow",
    )


class RequestHandlers:
    """The request handlers, bound to what they answer from (see the module docstring)."""

    __slots__ = ("state", "waiters", "end_session", "max_frame_size")

    def __init__(
        self,
        state: KVState,
        waiters: "Waiters",
        end_session: Callable[["Session"], None],
        max_frame_size: int,
    ) -> None:
        self.state = state
        self.waiters = waiters
        self.end_session = end_session
        self.max_frame_size = max_frame_size

    def table(self) -> list[Handler]:
        """The handler of each opcode (0-255), unknown ones included."""
        h: list[Handler] = [unknown_op] * 256
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
        h[P.OP_WATCH_GET] = self._op_watch_get
        h[P.OP_MULTI_SET_IF] = self._op_multi_set_if
        return h

    def _op_ping(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        return P.ok(rid)

    def _op_set(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        key, value, ephemeral = _dec_set(buf, pos, end)
        changed = self.state.set(key, value, conn.session.id if ephemeral else 0)  # type: ignore[union-attr]
        if self.waiters:
            self.waiters.wake(changed)
        return None if buf[pos] & _QUIET else _ok(rid)

    def _op_get(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        key, blocking, wait_ms = _dec_get(buf, pos, end)
        value = self.state.get(key)
        if value is not None:
            if blocking:
                return _RESP_pack(_HEAD_SIZE + len(value), _OK, rid) + value
            return _ok(rid, P.FOUND + value)
        if not blocking:
            return P.ok(rid, P.NOT_FOUND)
        if wait_ms == 0:
            return P.timeout(rid, [key])
        self.waiters.add(Waiter(conn, rid, P.OP_GET, [key], 0), wait_ms)
        return None

    def _op_add(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        key, amount = _DEC[P.OP_ADD](buf, pos, end)
        result, changed = self.state.add(key, amount)
        if self.waiters:
            self.waiters.wake(changed)
        return P.ok(rid, str(result).encode())

    def _op_compare_set(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        key, expected, desired, ephemeral = _DEC[P.OP_COMPARE_SET](buf, pos, end)
        result, changed = self.state.compare_set(
            key, expected, desired, conn.session.id if ephemeral else 0  # type: ignore[union-attr]
        )
        if changed and self.waiters:
            self.waiters.wake(changed)
        return P.ok(rid, result)

    def _blocking_keys(self, conn: "Conn", rid: int, op: int, keys: list[str], wait_ms: int) -> bytes | None:
        w = Waiter(conn, rid, op, keys, 0)
        resp = self.waiters.answer_now(w)
        if resp is not None:
            return resp
        if wait_ms == 0:
            state = self.state
            return P.timeout(rid, [k for k in keys if not state.contains(k)])
        self.waiters.add(w, wait_ms)
        return None

    def _op_wait(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        keys, wait_ms = _DEC[P.OP_WAIT](buf, pos, end)
        return self._blocking_keys(conn, rid, P.OP_WAIT, keys, wait_ms)

    def _op_multi_get(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        keys, wait_ms = _DEC[P.OP_MULTI_GET](buf, pos, end)
        return self._blocking_keys(conn, rid, P.OP_MULTI_GET, keys, wait_ms)

    def _op_check(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (keys,) = _DEC[P.OP_CHECK](buf, pos, end)
        contains = self.state.contains
        return P.ok(rid, P.TRUE if all(contains(k) for k in keys) else P.FALSE)

    def _op_delete(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (key,) = _DEC[P.OP_DELETE](buf, pos, end)
        changed = self.state.delete(key)
        if changed and self.waiters:
            self.waiters.wake(changed)
        return P.ok(rid, P.TRUE if changed else P.FALSE)

    def _op_num_keys(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        _DEC[P.OP_NUM_KEYS](buf, pos, end)
        return P.ok(rid, P.U64.pack(self.state.num_keys()))

    def _op_multi_set(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        keys, values = _DEC[P.OP_MULTI_SET](buf, pos, end)
        if keys:
            changed = self.state.multi_set(keys, values)
            if self.waiters:
                self.waiters.wake(changed)
        return P.ok(rid)

    def _op_multi_set_if(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        conditions, keys, values = _DEC[P.OP_MULTI_SET_IF](buf, pos, end)
        written, changed = self.state.multi_set_if(conditions, keys, values)
        if changed and self.waiters:
            self.waiters.wake(changed)
        return P.ok(rid, P.TRUE if written else P.FALSE)

    def _op_append(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        key, value = _DEC[P.OP_APPEND](buf, pos, end)
        changed = self.state.append(key, value)
        if self.waiters:
            self.waiters.wake(changed)
        return P.ok(rid)

    def _op_list_keys(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (prefix,) = _DEC[P.OP_LIST_KEYS](buf, pos, end)
        payload = P.payload_items(self.state.list_keys(prefix))
        if len(payload) + P.HEAD_SIZE > self.max_frame_size:
            raise StoreValueError(
                f"list_keys({prefix!r}) would answer {len(payload)} bytes, more than the "
                f"maximum frame size {self.max_frame_size}"
            )
        return P.ok(rid, payload)

    def _op_count_keys(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (prefix,) = _DEC[P.OP_COUNT_KEYS](buf, pos, end)
        return P.ok(rid, P.U64.pack(self.state.count_keys(prefix)))

    def _op_revision(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        (path,) = _DEC[P.OP_REVISION](buf, pos, end)
        return P.ok(rid, P.U64.pack(self.state.path_revision(path)))

    def _op_watch(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        path, since, wait_ms = _DEC[P.OP_WATCH](buf, pos, end)
        return self._watch(Waiter(conn, rid, P.OP_WATCH, [path], since), wait_ms)

    def _op_watch_get(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes | None:
        path, key, since, wait_ms = _DEC[P.OP_WATCH_GET](buf, pos, end)
        return self._watch(Waiter(conn, rid, P.OP_WATCH_GET, [path], since, key), wait_ms)

    def _watch(self, w: Waiter, wait_ms: int) -> bytes | None:
        """Answer watch(_get) ``w`` now if its path changed after ``since`` (or it may not
        wait), else register it."""
        rev = self.state.path_revision(w.keys[0])
        if rev > w.since or wait_ms == 0:
            return self.waiters.watch_answer(w, rev)
        self.waiters.add(w, wait_ms)
        return None

    def _op_close_session(self, conn: "Conn", rid: int, buf: bytes, pos: int, end: int) -> bytes:
        _DEC[P.OP_CLOSE_SESSION](buf, pos, end)
        sess = conn.session
        if sess is not None:
            conn.session = None
            self.end_session(sess)
        conn.finish()
        return P.ok(rid)
