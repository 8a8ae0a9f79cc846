"""A connection's account in the server's memory budget: what its buffers count for.

An :class:`Accounting` is a part of :class:`~rdzv.server._conn.Conn`: :meth:`Accounting.account`
tells the budget (:mod:`._budget`) what the connection buffers whenever that changes by much, and
the budget names the connections to shed, which the server's core drops with the error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ._budget import TRACK_MIN, MemoryBudget

if TYPE_CHECKING:
    from ._conn import Conn


class Accounting:
    """The bytes ``conn``'s buffers count for in ``budget``; ``shed`` drops whom it exceeds."""

    __slots__ = ("conn", "budget", "shed", "held")

    def __init__(
        self, conn: "Conn", budget: "MemoryBudget[Conn]", shed: "Callable[[list[Conn]], None]"
    ) -> None:
        self.conn = conn
        self.budget = budget
        self.shed = shed
        self.held = 0
        """The bytes the connection's buffers count for in the memory budget."""

    def account(self) -> None:
        """Tell the memory budget what the connection buffers now (shedding what exceeds it)."""
        conn = self.conn
        held = conn.unsent_size + conn.out_size
        if conn.chunks is not None:
            held += conn.need  # all of it, from its first bytes
        if conn.deferred is not None:
            held += len(conn.deferred)
        if held < TRACK_MIN:
            held = 0
        if held != self.held:
            self.held = held
            victims = self.budget.update(conn, held)
            if victims:
                self.shed(victims)

    def release(self) -> None:
        """Count the connection's buffers no more (it is closed, or shed)."""
        if self.held:
            self.held = 0
            self.budget.update(self.conn, 0)

    def holds(self) -> str:
        """What the connection's buffers hold, in words (for the log)."""
        conn = self.conn
        parts = []
        if conn.chunks is not None:
            parts.append(f"a request of {conn.need - 4} bytes, {conn.chunks_len} received")
        if conn.unsent:
            parts.append(f"{conn.unsent_size} bytes of answers it has not read")
        if conn.deferred is not None:
            parts.append(f"{len(conn.deferred) - conn.dpos} bytes of requests not handled yet")
        return ", ".join(parts) or "nothing"
