"""Waiters: blocking reads (get, wait, multi_get) and watches that cannot be answered at once.

A :class:`Waiter` is registered under the paths it cares about (its keys, or the watched path)
and answered the moment a write touches one of them and satisfies it, or when its wait runs out
(TIMEOUT with the keys still missing; a watch answers with the current revision).
:class:`Waiters`, the registry of the server's core (:class:`~rdzv.server._core.Core`), maps
each path to the waiters on it: the request handlers add to it, and every write that finds it
not empty wakes it with the keys it changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


class Waiters(dict[str, set[Waiter]]):
    """The waiters of the server by the paths they wait on (path -> waiters), answered from
    ``state``: empty, a write has no one to wake (a cheap test, as for any dict)."""

    __slots__ = ("loop", "state", "send_at_once")

    def __init__(self, loop: "EventLoop", state: KVState, send_at_once: bool) -> None:
        super().__init__()
        self.loop = loop
        self.state = state
        self.send_at_once = send_at_once
        """No write-ahead log: a woken waiter is answered at once (else once the log has it)."""

    def add(self, w: Waiter, wait_ms: int) -> None:
        """Register ``w`` until a write satisfies it or ``wait_ms`` ran out."""
        for path in w.keys:
            ws = self.get(path)
            if ws is None:
                self[path] = {w}
            else:
                ws.add(w)
        w.conn.waiters.add(w)
        w.timer = self.loop.call_later(wait_ms / 1000.0, self._timeout, w)

    def remove(self, w: Waiter) -> None:
        """Unregister ``w`` (answered, timed out, or its connection gone)."""
        w.done = True
        if w.timer is not None:
            w.timer.cancel()
            w.timer = None
        for path in w.keys:
            ws = self.get(path)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del self[path]
        w.conn.waiters.discard(w)

    def wake(self, changed: list[str]) -> None:
        """Answer the waiters that a change of the keys ``changed`` satisfies."""
        get = self.get
        hit: list[Waiter] = []
        for key in changed:
            for path in dir_paths(key):
                ws = get(path)
                if ws:
                    hit.extend(ws)
        send_now = self.send_at_once
        for w in hit:
            if not w.done:
                resp = self.answer_now(w)
                if resp is not None:
                    self.remove(w)
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

    def _timeout(self, w: Waiter) -> None:
        w.timer = None
        if w.done:
            return
        self.remove(w)
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
