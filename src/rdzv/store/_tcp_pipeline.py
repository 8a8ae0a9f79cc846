"""The requests a TCPStore connection has in flight, and the reading of their answers.

:class:`Pipeline` is the part of a :class:`~rdzv.store._tcp_conn.StoreConnection` that keeps
order: the pipelined writes sent but not yet confirmed (kept to be resent after a reconnect;
after a session expired, only those safe to apply again), the writes a batch holds back, and
the answers read off the socket, which come in request order and so confirm the writes sent
before them. The connection calls it with its lock held; it never sends anything itself.
"""

from __future__ import annotations

import socket
from collections import deque

from ..errors import StoreError, StoreProtocolError
from ..kv import protocol as P
from . import _tcp_errors as E

MAX_UNACKED_WRITES = 256
"""Pipelined writes a client may have unacknowledged before a write waits for their answers."""
MAX_UNACKED_BYTES = 4 << 20
"""... and their total size in bytes (the client keeps them to resend after a reconnect)."""
_RESP_unpack_from = P.RESP_HEAD.unpack_from
_OK = P.STATUS_OK


class Pipeline:
    """What the connection to the store server at ``addr`` sent and has not had answered."""

    def __init__(self, addr: str) -> None:
        self._addr = addr
        self.unacked: deque[tuple[int, bytes, str, str | None]] = deque()
        """Pipelined writes sent but not yet acknowledged: (request id, frame, op name, key)."""
        self.unacked_bytes = 0
        self.write_error: StoreError | None = None
        """The failure of a pipelined write, for the next call to raise."""
        self.held: list[bytes] = []
        """Pipelined writes made inside a batch, not sent yet (each is in :attr:`unacked`):
        they go out with the next request (one message instead of several), at the latest
        when the batch ends."""
        self.max_frame = P.DEFAULT_MAX_FRAME_SIZE
        """The largest frame body the server takes (its WELCOME says)."""
        self._rbuf = b""

    def with_held(self, frame: bytes) -> bytes:
        """``frame`` after the held writes, which are then no longer held."""
        if not self.held:
            return frame
        self.held.append(frame)
        data = b"".join(self.held)
        self.held.clear()
        return data

    def disconnected(self) -> None:
        """The socket is gone: what was read of it, and the holding back (each held write is
        unacknowledged: the reconnect resends it)."""
        self._rbuf = b""
        self.held.clear()

    def unconfirmed(self) -> bytes:
        """Every unacknowledged write, in order: to resend over a new connection."""
        return b"".join([frame for _, frame, _, _ in self.unacked])

    def drop_unresendable(self) -> list[str]:
        """The session expired: forget the unacknowledged writes that must not be sent again
        in the new session (see :data:`~rdzv.kv.protocol.RESENDABLE_AFTER_EXPIRY`);
        returns them, named (``set('key')``), for the error that reports them."""
        kept: deque[tuple[int, bytes, str, str | None]] = deque()
        dropped = []
        for unacked in self.unacked:
            if P.resendable_after_expiry(unacked[1]):
                kept.append(unacked)
            else:
                dropped.append(f"{unacked[2]}({unacked[3]!r})")
        self.unacked_bytes = sum(len(u[1]) for u in kept)
        self.unacked = kept
        return dropped

    def read(self, sock: socket.socket, rid: int) -> tuple[int, bytes]:
        """(status, payload) of the answer to request ``rid``, read off ``sock``; the answers
        before it confirm (or fail) the pipelined writes sent before it."""
        buf = self._rbuf or sock.recv(65536)  # usually nothing is left over: read at once
        while True:
            size = len(buf)
            if size >= 9:
                length, status, r = _RESP_unpack_from(buf)
                end = length + 4
                if size >= end:
                    if size == end:
                        payload = buf[9:]
                        buf = b""
                    else:
                        payload = buf[9:end]
                        buf = buf[end:]
                    unacked = self.unacked
                    if unacked:
                        # Answers come in request order: one to request r implies that every
                        # write sent before it succeeded (quiet SETs are answered only on error).
                        if unacked[-1][0] < r:
                            unacked.clear()
                            self.unacked_bytes = 0
                        while unacked and unacked[0][0] < r:
                            self._acknowledged(_OK, b"")
                        if unacked and unacked[0][0] == r:
                            self._acknowledged(status, payload)
                            continue
                    if r == rid:
                        self._rbuf = buf
                        return status, payload
                    if r == 0 and status == P.STATUS_ERROR:
                        raise E.closed_by_server(self._addr, payload)
                    continue  # the answer to a request given up on earlier
                if length < P.HEAD_SIZE or length > self.max_frame + (1 << 20):
                    raise StoreProtocolError(
                        f"malformed response frame ({length} bytes) from the store server at "
                        f"{self._addr}"
                    )
                if end > 1 << 20:
                    buf = _recv_exactly(sock, buf, end)
                    continue
            chunk = sock.recv(65536)
            if not chunk:
                raise E.ConnectionLost("the server closed the connection")
            buf = buf + chunk if buf else chunk

    def _acknowledged(self, status: int, payload: bytes) -> None:
        """The answer to the oldest pipelined write arrived; keep its error for the next call."""
        _, frame, what, key = self.unacked.popleft()
        self.unacked_bytes -= len(frame)
        if status != _OK and self.write_error is None:
            err = E.answer_error(self._addr, status, payload, what, key)
            self.write_error = E.earlier_write_failed(err, what, key)


def _recv_exactly(sock: socket.socket, head: bytes, size: int) -> bytes:
    data = bytearray(size)
    view = memoryview(data)
    have = len(head)
    view[:have] = head
    while have < size:
        n = sock.recv_into(view[have:])
        if n == 0:
            raise E.ConnectionLost("the server closed the connection")
        have += n
    return bytes(data)
