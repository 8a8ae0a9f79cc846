"""A connection's part in the server's memory budget: what it buffers, and being shed.

A part of :class:`~rdzv.server._conn.Conn`: :meth:`Accounting.account` tells the budget
(:mod:`._budget`) what the connection buffers whenever that changes by much, and the budget
names the connections to shed, which :meth:`Accounting.shed` drops with the error.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Union

from ..kv import protocol as P
from ._budget import TRACK_MIN
from ._greeting import Greeting

if TYPE_CHECKING:
    from ._core import Core

log = logging.getLogger("rdzv.server")
_HEAD_unpack_from = P.BODY_HEAD.unpack_from


class Accounting(Greeting):
    """The memory budget steps of :class:`~rdzv.server._conn.Conn` (which has the buffers)."""

    __slots__ = ("held", "chunks", "deferred")
    held: int
    """The bytes this connection's buffers count for in the memory budget."""
    chunks: list[bytes] | None
    """The start of a frame not yet read whole (``need`` bytes in all)."""
    deferred: bytes | None
    """Requests read but not handled yet (from ``dpos`` on)."""
    core: "Core"
    chunks_len: int
    need: int
    dpos: int
    out_size: int
    unsent: deque[Union[bytes, memoryview]]
    unsent_size: int
    closing: bool

    def lost(self, exc: BaseException | None) -> None:  # pragma: no cover - Conn's
        raise NotImplementedError

    def account(self) -> None:
        """Tell the memory budget what this connection buffers now (shedding what exceeds it)."""
        held = self.unsent_size + self.out_size
        if self.chunks is not None:
            held += self.need  # all of it, from its first bytes
        if self.deferred is not None:
            held += len(self.deferred)
        if held < TRACK_MIN:
            held = 0
        if held != self.held:
            self.held = held
            victims = self.core.budget.update(self, held)
            if victims:
                self.core.shed(victims)

    def holds(self) -> str:
        """What this connection's buffers hold, in words (for the log)."""
        parts = []
        if self.chunks is not None:
            parts.append(f"a request of {self.need - 4} bytes, {self.chunks_len} received")
        if self.unsent:
            parts.append(f"{self.unsent_size} bytes of answers it has not read")
        if self.deferred is not None:
            parts.append(f"{len(self.deferred) - self.dpos} bytes of requests not handled yet")
        return ", ".join(parts) or "nothing"

    def shed(self, why: str) -> None:
        """Drop this connection to keep the server in its memory budget, freeing its buffers.

        Its session is kept for a ttl, for the client to resume; a request it was sending is
        answered with the error (and not applied), the requests after it are not read."""
        core = self.core
        core.budget.update(self, 0)
        self.held = 0
        sess = self.session
        if sess is not None and sess.conn is self:
            self.session = None
            core.detach_session(sess, time.monotonic())
        rid = 0
        chunks = self.chunks
        if chunks is not None and self.chunks_len >= 4 + P.HEAD_SIZE and len(chunks[0]) >= 9:
            rid = _HEAD_unpack_from(chunks[0], 4)[1]  # (assembled below 9 bytes: unnamed)
        self.chunks = None
        self.deferred = None
        if self.unsent or self.closing:  # in the middle of its answers: no error can follow
            log.warning("dropping the connection from %s: %s", self.peer, why)
            self.lost(None)
        else:
            self.drop(why, P.error(rid, P.E_BUSY, why))
