"""Handshake codecs: HELLO, CHALLENGE, AUTH and WELCOME (version, shared-secret proofs, session).

Part of :mod:`rdzv.kv.protocol`.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ._wire import (
    CHALLENGE_FLAG_AUTH_REQUIRED,
    HELLO_FLAG_HAS_SECRET,
    HS_OK,
    MAC_SIZE,
    MAGIC,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    TOKEN_SIZE,
    ProtocolError,
    U8,
    _CHALLENGE,
    _HELLO,
    _WELCOME,
    frame,
)


# -- handshake ------------------------------------------------------------------------------
class Hello(NamedTuple):
    version: int
    flags: int
    ttl: float
    resume_session: int
    resume_token: bytes
    """The token the server gave with ``resume_session`` (proof of owning it)."""
    nonce: bytes


class Challenge(NamedTuple):
    version: int
    status: int
    auth_required: bool
    nonce: bytes
    message: str


class Welcome(NamedTuple):
    status: int
    session: int
    resumed: bool
    max_frame_size: int
    ttl: float
    token: bytes
    """The session's resume token: only its owner knows it."""
    proof: bytes
    message: str


def encode_hello(
    ttl: float, resume_session: int, resume_token: bytes, nonce: bytes, has_secret: bool
) -> bytes:
    flags = HELLO_FLAG_HAS_SECRET if has_secret else 0
    token = resume_token if resume_session else bytes(TOKEN_SIZE)
    return frame(_HELLO.pack(MAGIC, PROTOCOL_VERSION, flags, ttl, resume_session, token, nonce))


def decode_hello(body: bytes) -> Hello:
    """The HELLO of a client. A peer of another protocol version gets a Hello whose fields
    after ``version`` are empty (the server answers with a version mismatch)."""
    if len(body) < 6 or body[:4] != MAGIC:
        raise ProtocolError("not an rdzv store client (bad handshake magic)")
    (version,) = struct.unpack_from("<H", body, 4)
    if version != PROTOCOL_VERSION:
        return Hello(version, 0, 0.0, 0, b"", b"")
    if len(body) != _HELLO.size:
        raise ProtocolError(f"malformed HELLO of {len(body)} bytes")
    _, version, flags, ttl, resume, token, nonce = _HELLO.unpack(body)
    if not ttl >= 0.0 or ttl == float("inf"):  # also rejects NaN
        raise ProtocolError(f"invalid session ttl {ttl!r} in HELLO")
    return Hello(version, flags, ttl, resume, token, nonce)


def encode_challenge(status: int, auth_required: bool, nonce: bytes = b"", message: str = "") -> bytes:
    head = _CHALLENGE.pack(
        MAGIC, PROTOCOL_VERSION, status, CHALLENGE_FLAG_AUTH_REQUIRED if auth_required else 0
    )
    tail = nonce if status == HS_OK else message.encode("utf-8", "replace")
    return frame(head + tail)


def decode_challenge(body: bytes) -> Challenge:
    if len(body) < _CHALLENGE.size or body[:4] != MAGIC:
        raise ProtocolError("the peer is not an rdzv store server (bad handshake magic)")
    _, version, status, flags = _CHALLENGE.unpack_from(body, 0)
    rest = body[_CHALLENGE.size :]
    if status == HS_OK:
        if version != PROTOCOL_VERSION or len(rest) != NONCE_SIZE:
            raise ProtocolError(f"malformed CHALLENGE from a server speaking version {version}")
        return Challenge(version, status, bool(flags & CHALLENGE_FLAG_AUTH_REQUIRED), rest, "")
    return Challenge(version, status, False, b"", rest.decode("utf-8", "replace"))


def encode_auth(mac: bytes) -> bytes:
    return frame(mac)


def decode_auth(body: bytes) -> bytes:
    if len(body) not in (0, MAC_SIZE):
        raise ProtocolError(f"malformed AUTH of {len(body)} bytes")
    return body


def encode_welcome(
    status: int,
    session: int = 0,
    resumed: bool = False,
    max_frame_size: int = 0,
    ttl: float = 0.0,
    token: bytes = b"",
    proof: bytes = b"",
    message: str = "",
) -> bytes:
    if status != HS_OK:
        return frame(U8.pack(status) + message.encode("utf-8", "replace"))
    return frame(_WELCOME.pack(status, session, resumed, max_frame_size, ttl, token) + proof)


def decode_welcome(body: bytes) -> Welcome:
    if not body:
        raise ProtocolError("empty WELCOME")
    status = body[0]
    if status != HS_OK:
        return Welcome(status, 0, False, 0, 0.0, b"", b"", body[1:].decode("utf-8", "replace"))
    if len(body) not in (_WELCOME.size, _WELCOME.size + MAC_SIZE):
        raise ProtocolError(f"malformed WELCOME of {len(body)} bytes")
    status, session, resumed, max_frame, ttl, token = _WELCOME.unpack_from(body, 0)
    return Welcome(status, session, bool(resumed), max_frame, ttl, token, body[_WELCOME.size :], "")
