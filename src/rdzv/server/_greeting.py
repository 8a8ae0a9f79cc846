"""The handshake of a connection: HELLO answered by CHALLENGE, then AUTH answered by WELCOME.

A part of :class:`~rdzv.server._conn.Conn`: the protocol version is checked, the shared secret
proved (when the server has one) and the client's session attached (opened, or resumed with its
token: :meth:`~rdzv.server._core.Core.attach_session`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

from ..kv import auth, protocol as P

if TYPE_CHECKING:
    from ._conn import Conn
    from ._core import Core, Session
    from ._loop import Timer

log = logging.getLogger("rdzv.server")

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a new connection has to complete the handshake."""
READY = 2
"""Phase of a connection past its handshake (0: awaiting HELLO, 1: awaiting AUTH)."""


class Greeting:
    """The handshake steps of :class:`~rdzv.server._conn.Conn` (which has the attributes)."""

    __slots__ = ("phase", "hello", "server_nonce", "session", "ttl", "max_frame", "timer")
    core: "Core"
    peer: str
    phase: int
    hello: P.Hello | None
    server_nonce: bytes
    session: "Session | None"
    ttl: float
    max_frame: int
    timer: "Timer | None"
    last_recv: float

    def drop(self, why: str, last_frame: bytes | None = None) -> None:  # pragma: no cover
        raise NotImplementedError

    def queue(self, frame: bytes) -> None:  # pragma: no cover
        raise NotImplementedError

    def arm_ttl(self, when: float) -> None:  # pragma: no cover
        raise NotImplementedError

    def _oversized(self, length: int) -> None:
        msg = f"frame of {length} bytes exceeds the maximum frame size of {self.max_frame} bytes"
        if self.phase != READY:
            self.drop(f"bad handshake ({msg}; not an rdzv client?)")
        else:
            self.drop(msg, P.error(0, P.E_FRAME_TOO_LARGE, msg))

    # -- handshake -------------------------------------------------------------------------------
    def handshake(self, body: bytes) -> None:
        """Handle a handshake frame: HELLO (answered by CHALLENGE), then AUTH (by WELCOME)."""
        core = self.core
        if self.phase == 0:
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
            self.server_nonce = auth.new_nonce(P.NONCE_SIZE)
            self.phase = 1
            self.queue(P.encode_challenge(P.HS_OK, core.secret is not None, self.server_nonce))
            return
        greeted = self.hello
        assert greeted is not None
        try:
            mac = P.decode_auth(body)
        except P.ProtocolError as exc:
            self.drop(f"bad handshake: {exc}")
            return
        proof = b""
        if core.secret is not None:
            expected = auth.client_proof(core.secret, greeted.nonce, self.server_nonce)
            if not mac or not auth.verify(expected, mac):
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
            proof = auth.server_proof(core.secret, greeted.nonce, self.server_nonce)
        sess, resumed = core.attach_session(cast("Conn", self), greeted)
        self.session = sess
        self.ttl = greeted.ttl
        self.phase = READY
        self.max_frame = core.max_frame_size
        self.hello = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if greeted.ttl > 0:
            self.arm_ttl(self.last_recv + greeted.ttl)
        self.queue(
            P.encode_welcome(
                P.HS_OK, sess.id, resumed, core.max_frame_size, greeted.ttl, sess.token, proof
            )
        )
        log.debug("%s: session %d %s", self.peer, sess.id, "resumed" if resumed else "opened")

    def _handshake_timeout(self) -> None:
        self.timer = None
        if self.phase != READY:
            self.drop(f"no handshake within {HANDSHAKE_TIMEOUT:g} s")
