"""The handshake of a connection: HELLO answered by CHALLENGE, then AUTH answered by WELCOME.

A :class:`Greeting` is the handshake of one :class:`~rdzv.server._conn.Conn`, which has it
until the WELCOME: the protocol version is checked, the shared secret proved (when the server
has one) and the client's session attached (opened, or resumed with its token) through the
:class:`Host`, the server's core.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from ..kv import auth, protocol as P

if TYPE_CHECKING:
    from ._conn import Conn
    from ._core import Session

log = logging.getLogger("rdzv.server")


class Host(Protocol):
    """What a handshake needs of the server: its secret, its frame limit, its session table."""

    secret: bytes | None
    max_frame_size: int

    def attach_session(self, conn: "Conn", hello: P.Hello) -> "tuple[Session, bool]":
        """The client's session (opened, or resumed with its token), and whether resumed."""
        ...


class Greeting:
    """The handshake of ``conn`` with the server ``host`` (see the module docstring)."""

    __slots__ = ("conn", "host", "hello", "server_nonce")

    def __init__(self, conn: "Conn", host: Host) -> None:
        self.conn = conn
        self.host = host
        self.hello: P.Hello | None = None
        """The client's HELLO, once answered (its AUTH is awaited then)."""
        self.server_nonce = b""

    def step(self, body: bytes) -> None:
        """Handle a handshake frame: HELLO (answered by CHALLENGE), then AUTH (by WELCOME)."""
        conn = self.conn
        host = self.host
        if self.hello is None:
            try:
                hello = P.decode_hello(body)
            except P.ProtocolError as exc:
                conn.drop(f"bad handshake: {exc}")
                return
            if hello.version != P.PROTOCOL_VERSION:
                msg = (
                    f"protocol version mismatch: the server speaks version {P.PROTOCOL_VERSION}, "
                    f"the client version {hello.version}"
                )
                conn.drop(msg, P.encode_challenge(P.HS_VERSION_MISMATCH, False, message=msg))
                return
            self.hello = hello
            self.server_nonce = auth.new_nonce(P.NONCE_SIZE)
            conn.queue(P.encode_challenge(P.HS_OK, host.secret is not None, self.server_nonce))
            return
        greeted = self.hello
        try:
            mac = P.decode_auth(body)
        except P.ProtocolError as exc:
            conn.drop(f"bad handshake: {exc}")
            return
        proof = b""
        if host.secret is not None:
            expected = auth.client_proof(host.secret, greeted.nonce, self.server_nonce)
            if not mac or not auth.verify(expected, mac):
                why = (
                    "the server requires a shared secret and the client sent none"
                    if not mac
                    else "the client's secret does not match the server's"
                )
                conn.drop(
                    f"authentication failed: {why}",
                    P.encode_welcome(P.HS_AUTH_FAILED, message=f"authentication failed: {why}"),
                )
                return
            proof = auth.server_proof(host.secret, greeted.nonce, self.server_nonce)
        sess, resumed = host.attach_session(conn, greeted)
        conn.greeted(sess, greeted.ttl)
        conn.queue(
            P.encode_welcome(
                P.HS_OK, sess.id, resumed, host.max_frame_size, greeted.ttl, sess.token, proof
            )
        )
        log.debug("%s: session %d %s", conn.peer, sess.id, "resumed" if resumed else "opened")
