"""Waiters: blocking reads (get, wait, multi_get) and watches that cannot be answered at once.

A :class:`Waiter` is registered under the paths it cares about (its keys, or the watched path)
and answered the moment a write touches one of them and satisfies it, or when its wait runs out
(TIMEOUT with the keys still missing; a watch answers with the current revision).
:class:`Waiters` is a part of :class:`~rdzv.server._core.Core`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..kv import KVState, dir_paths, protocol as P

if TYPE_CHECKING:
    from ._conn import Conn
    from ._loop import EventLoop, Timer


class Waiter:
    """A request waiting for keys to appear (get/wait/multi_get) or a path to change (watch)."""

    __slots__ = ("conn", "rid", "op", "keys", "since", "read", "timer", "done")

    def __init__(
        self, conn: "Conn", rid: int, op: int, keys: list[str], since: int, read: str = ""
    ) -> None:
        self.conn = conn
        self.rid = rid
        self.op = op
        self.keys = keys  # the keys awaited, or [path] for a watch
        self.since = since
        self.read = read  # the key whose value a watch_get answers with
        self.timer: Timer | None = None
        self.done = False


class Waiters:
    """The waiter registry of :class:`~rdzv.server._core.Core`: path -> waiters on it."""

    loop: EventLoop
    state: KVState
    wal: Any
    waiters: dict[str, set[Waiter]]

    def add_waiter(self, w: Waiter, wait_ms: int) -> None:
        reg = self.waiters
        for path in w.keys:
            ws = reg.get(path)
            if ws is None:
                reg[path] = {w}
            else:
                ws.add(w)
        w.conn.waiters.add(w)
        w.timer = self.loop.call_later(wait_ms / 1000.0, self._waiter_timeout, w)

    def remove_waiter(self, w: Waiter) -> None:
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
        hit: list[Waiter] = []
        for key in changed:
            for path in dir_paths(key):
                ws = reg.get(path)
                if ws:
                    hit.extend(ws)
        send_now = self.wal is None  # else the answers wait for the log
        for w in hit:
            if not w.done:
                resp = self.answer_now(w)
                if resp is not None:
                    self.remove_waiter(w)
                    w.conn.queue(resp)
                    if send_now:  # the first woken clients run while the others are answered
                        w.conn.flush_out()

    def answer_now(self, w: Waiter) -> bytes | None:
        """The response for ``w`` if it can be answered now, else None."""
        state = self.state
        op = w.op
        if op == P.OP_WATCH or op == P.OP_WATCH_GET:
            rev = state.path_revision(w.keys[0])
            return self.watch_answer(w, rev) if rev > w.since else None
        if op == P.OP_GET:
            value = state.get(w.keys[0])
            return None if value is None else P.ok(w.rid, value)
        values = [state.get(k) for k in w.keys]
        if None in values:
            return None
        if op == P.OP_WAIT:
            return P.ok(w.rid)
        return P.ok(w.rid, P.payload_values(values))  # type: ignore[arg-type]

    def _waiter_timeout(self, w: Waiter) -> None:
        w.timer = None
        if w.done:
            return
        self.remove_waiter(w)
        if w.op == P.OP_WATCH or w.op == P.OP_WATCH_GET:
            resp = self.watch_answer(w, self.state.path_revision(w.keys[0]))
        else:
            state = self.state
            resp = P.timeout(w.rid, [k for k in w.keys if not state.contains(k)])
        w.conn.queue(resp)

    def watch_answer(self, w: Waiter, revision: int) -> bytes:
        """The answer to watch(_get) ``w`` with its path at ``revision``."""
        if w.op == P.OP_WATCH:
            return P.ok(w.rid, P.U64.pack(revision))
        return P.ok(w.rid, P.payload_watch_get(revision, self.state.get(w.read)))
