"""The TCPStore connection's handshake: HELLO, CHALLENGE, AUTH, WELCOME, and the session.

A part of :class:`~rdzv.store._tcp_conn.StoreConnection`: it proves the shared secret (and
checks the server's proof), resumes this client's session with its token (or learns that the
session ended, dropping the ephemeral writes that died with it and raising
SessionExpiredError if ephemeral keys were lost), and resends the unacknowledged writes.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections import deque

from ..errors import SessionExpiredError, StoreAuthenticationError, StoreProtocolError
from ..kv import auth, protocol as P

log = logging.getLogger("rdzv.store.tcp")

HANDSHAKE_TIMEOUT = 10.0
_monotonic = time.monotonic
_SO_RCVTIMEO: int | None = getattr(socket, "SO_RCVTIMEO", None)
_SO_SNDTIMEO: int | None = getattr(socket, "SO_SNDTIMEO", None)


class _ConnectionLost(ConnectionError):
    """The server closed the connection (internal: triggers a reconnect)."""


class ClientHandshake:
    """The handshake steps of :class:`~rdzv.store._tcp_conn.StoreConnection` (its state)."""

    _host: str
    _port: int
    _secret: bytes | None
    _ttl: float
    _session: int
    _token: bytes
    _had_ephemeral: bool
    _unacked: deque[tuple[int, bytes, str, str | None]]
    _sock: socket.socket | None
    _stale: socket.socket | None
    _rbuf: bytes
    _max_frame: int
    _reply_timeout: float

    def _drop_unresendable(self) -> list[str]:  # pragma: no cover - StoreConnection's
        raise NotImplementedError

    @staticmethod
    def _set_reply_timeout(sock: socket.socket, seconds: float) -> None:
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

    def _close_stale(self) -> None:
        stale, self._stale = self._stale, None
        if stale is not None:
            try:
                stale.close()
            except OSError:  # pragma: no cover
                pass

    def _handshake(self, sock: socket.socket, deadline: float) -> None:
        addr = f"{self._host}:{self._port}"
        sock.settimeout(max(0.05, min(deadline - _monotonic(), HANDSHAKE_TIMEOUT)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(16)
        secret = self._secret
        sock.sendall(
            P.encode_hello(self._ttl, self._session, self._token, nonce, secret is not None)
        )
        try:
            challenge = P.decode_challenge(self._recv_handshake(sock))
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
            welcome = P.decode_welcome(self._recv_handshake(sock))
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
        sock.settimeout(None)
        self._set_reply_timeout(sock, self._reply_timeout)
        old = self._session
        expired = bool(old) and not welcome.resumed
        # What the expired session may or may not have applied is resent only where that is
        # harmless (docs/protocol.md, "Session expiry"): its ephemeral writes died with it.
        dropped = self._drop_unresendable() if expired else []
        if self._unacked:  # resent first, in order: the server applies each at most once
            sock.sendall(b"".join([f for _, f, _, _ in self._unacked]))
        self._close_stale()  # the server moved the session to this connection
        self._sock = sock
        self._rbuf = b""
        self._session = welcome.session
        self._token = welcome.token
        self._max_frame = welcome.max_frame_size
        if expired:
            log.warning(
                "store session %d at %s ended while disconnected; continuing in session %d",
                old,
                addr,
                welcome.session,
            )
            if self._had_ephemeral or dropped:
                lost = ", and its ephemeral keys with it" if self._had_ephemeral else ""
                shown = ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else "")
                unsent = (
                    f"; {len(dropped)} write(s) sent in it were not confirmed and are not sent "
                    f"again (each may or may not have been applied): {shown}" if dropped else ""
                )
                self._had_ephemeral = False
                raise SessionExpiredError(
                    f"the session {old} of this client at the store server {addr} expired while "
                    f"disconnected{lost}{unsent} (now in session {welcome.session})"
                )
        elif old:
            log.info("resumed store session %d at %s", old, addr)

    @staticmethod
    def _recv_handshake(sock: socket.socket) -> bytes:
        def exactly(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = sock.recv(n - len(data))
                if not chunk:
                    raise _ConnectionLost("the server closed the connection during the handshake")
                data += chunk
            return data

        (length,) = P.LEN.unpack(exactly(4))
        if length > P.HANDSHAKE_MAX_FRAME:
            raise P.ProtocolError(f"handshake frame of {length} bytes")
        return exactly(length)
