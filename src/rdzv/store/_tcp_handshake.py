"""The TCPStore connection's handshake: HELLO, CHALLENGE, AUTH, WELCOME.

:func:`handshake` runs on each new socket of a :class:`~rdzv.store._tcp_conn.StoreConnection`:
it offers the session to resume (its id and resume token), proves the shared secret and checks
the server's proof of it, and returns what the server's WELCOME said (the session this client
is now in, and whether it is the one offered). What follows from a new session is the
connection's (which writes it sends again, SessionExpiredError); this module holds no state.
:func:`set_reply_timeout` bounds the socket's later sends and receives.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from ..errors import StoreAuthenticationError, StoreProtocolError
from ..kv import auth, protocol as P
from ._tcp_errors import ConnectionLost

HANDSHAKE_TIMEOUT = 10.0
_monotonic = time.monotonic
_SO_RCVTIMEO: int | None = getattr(socket, "SO_RCVTIMEO", None)
_SO_SNDTIMEO: int | None = getattr(socket, "SO_SNDTIMEO", None)


def set_reply_timeout(sock: socket.socket, seconds: float) -> None:
    """Bound each send and receive on the connected ``sock`` by ``seconds`` (the socket stays
    blocking: a timeout is an OSError)."""
    if _SO_RCVTIMEO is not None and _SO_SNDTIMEO is not None:
        sec = int(seconds)
        tv = struct.pack("@ll", sec, int((seconds - sec) * 1e6))
        try:
            sock.setsockopt(socket.SOL_SOCKET, _SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, _SO_SNDTIMEO, tv)
            return
        except OSError:  # pragma: no cover - platform without timeval socket timeouts
            pass
    sock.settimeout(seconds)


def handshake(
    sock: socket.socket,
    addr: str,
    secret: bytes | None,
    ttl: float,
    session: int,
    token: bytes,
    deadline: float,
) -> P.Welcome:
    """Greet the store server at ``addr`` over the connected ``sock``, asking for a session of
    ``ttl`` seconds (resuming ``session`` with its ``token``; 0 and b"": a new one), and
    return its WELCOME (status OK; the server proved the secret, if any).

    Raises StoreProtocolError (not an rdzv server, another version, refused) or
    StoreAuthenticationError (a wrong or missing secret on either side); an OSError
    (ConnectionLost among them) where the connection failed, or no answer came by ``deadline``
    or within :data:`HANDSHAKE_TIMEOUT`: worth another try. ``sock`` keeps the handshake's
    timeout: setting the next one is the caller's.
    """
    sock.settimeout(max(0.05, min(deadline - _monotonic(), HANDSHAKE_TIMEOUT)))
    nonce = os.urandom(16)
    sock.sendall(P.encode_hello(ttl, session, token, nonce, secret is not None))
    try:
        challenge = P.decode_challenge(_recv_frame(sock))
    except P.ProtocolError as exc:
        raise StoreProtocolError(f"{addr} is not an rdzv store server: {exc}") from None
    if challenge.status != P.HS_OK:
        hint = (
            " (run the same rdzv version on the server and its clients)"
            if challenge.status == P.HS_VERSION_MISMATCH
            else ""
        )
        raise StoreProtocolError(
            f"the store server at {addr} refused this client: {challenge.message}{hint}"
        )
    if secret is not None and not challenge.auth_required:
        raise StoreAuthenticationError(
            f"this client has a shared secret but the store server at {addr} requires none; "
            "refusing to use an unauthenticated server"
        )
    mac = auth.client_proof(secret, nonce, challenge.nonce) if secret is not None else b""
    sock.sendall(P.encode_auth(mac))
    try:
        welcome = P.decode_welcome(_recv_frame(sock))
    except P.ProtocolError as exc:
        raise StoreProtocolError(f"bad handshake from the store server at {addr}: {exc}") from None
    if welcome.status == P.HS_AUTH_FAILED:
        hint = "" if secret is not None else " (pass secret= or set $RDZV_STORE_SECRET)"
        raise StoreAuthenticationError(
            f"the store server at {addr} refused this client: {welcome.message}{hint}"
        )
    if welcome.status != P.HS_OK:
        raise StoreProtocolError(f"the store server at {addr} refused this client: {welcome.message}")
    if secret is not None and not auth.verify(
        auth.server_proof(secret, nonce, challenge.nonce), welcome.proof
    ):
        raise StoreAuthenticationError(
            f"the store server at {addr} could not prove that it knows the shared secret"
        )
    return welcome


def _recv_frame(sock: socket.socket) -> bytes:
    """The body of the next handshake frame."""

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionLost("the server closed the connection during the handshake")
            data += chunk
        return data

    (length,) = P.LEN.unpack(exactly(4))
    if length > P.HANDSHAKE_MAX_FRAME:
        raise P.ProtocolError(f"handshake frame of {length} bytes")
    return exactly(length)
