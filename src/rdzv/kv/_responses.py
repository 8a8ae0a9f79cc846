"""Response codecs: the server's encoders (OK, ERROR, TIMEOUT, payloads) and the client's decoders.

A response body is ``u8 status, u32 request id, payload``. Part of :mod:`rdzv.kv.protocol`.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

from ._wire import (
    BODY_HEAD,
    HEAD_SIZE,
    ProtocolError,
    RESP_HEAD,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    U32,
    U64,
    _ERROR,
    _read_bytes,
    _strs,
)


# -- responses (server side encoders) -----------------------------------------------------
def ok(rid: int, payload: bytes = b"") -> bytes:
    return RESP_HEAD.pack(HEAD_SIZE + len(payload), STATUS_OK, rid) + payload


def error(rid: int, code: int, message: str) -> bytes:
    msg = message.encode("utf-8", "replace")[:8192]
    return _ERROR.pack(7 + len(msg), STATUS_ERROR, rid, code) + msg


def timeout(rid: int, missing: Sequence[str]) -> bytes:
    body = _strs([k.encode() for k in missing])
    return RESP_HEAD.pack(HEAD_SIZE + len(body), STATUS_TIMEOUT, rid) + body


FOUND = b"\x01"
NOT_FOUND = b"\x00"
TRUE = b"\x01"
FALSE = b"\x00"


def payload_u64(n: int) -> bytes:
    return U64.pack(n)


def payload_watch_get(revision: int, value: bytes | None) -> bytes:
    """WATCH_GET's answer: the path's revision, then the key's value if it exists."""
    return U64.pack(revision) + (NOT_FOUND if value is None else FOUND + value)


def decode_watch_get(payload: bytes) -> tuple[int, bytes | None]:
    """(revision, value or None) of a WATCH_GET answer."""
    if len(payload) < 9:
        raise ProtocolError(f"malformed watch_get response ({len(payload)} bytes)")
    (revision,) = U64.unpack_from(payload, 0)
    return revision, payload[9:] if payload[8] else None


def payload_values(values: Sequence[bytes]) -> bytes:
    return _strs(values)


def payload_items(items: dict[str, bytes]) -> bytes:
    pack = U32.pack
    parts = [U32.pack(len(items))]
    for k, v in items.items():
        kb = k.encode()
        parts.append(pack(len(kb)) + kb + pack(len(v)) + v)
    return b"".join(parts)


# -- responses (client side decoders) -----------------------------------------------------
def decode_response(body: bytes) -> tuple[int, int, bytes]:
    """(status, request id, payload) of a response body."""
    if len(body) < HEAD_SIZE:
        raise ProtocolError(f"response of {len(body)} bytes is shorter than its header")
    status, rid = BODY_HEAD.unpack_from(body, 0)
    if status not in (STATUS_OK, STATUS_ERROR, STATUS_TIMEOUT):
        raise ProtocolError(f"unknown response status {status}")
    return status, rid, body[HEAD_SIZE:]


def decode_error(payload: bytes) -> tuple[int, str]:
    """(code, message) of an ERROR payload."""
    if len(payload) < 2:
        raise ProtocolError("truncated error response")
    (code,) = struct.unpack_from("<H", payload, 0)
    return code, payload[2:].decode("utf-8", "replace")


def _guard(fn: Callable[[bytes], object], payload: bytes, what: str):  # type: ignore[no-untyped-def]
    try:
        return fn(payload)
    except (struct.error, UnicodeDecodeError, ValueError, IndexError) as exc:
        raise ProtocolError(f"malformed {what} response: {exc}") from None


def _values(payload: bytes) -> list[bytes]:
    end = len(payload)
    (n,) = U32.unpack_from(payload, 0)
    pos = 4
    if n * 4 > end - pos:
        raise ProtocolError(f"value count {n} does not fit the frame")
    out = []
    for _ in range(n):
        value, pos = _read_bytes(payload, pos, end, "value")
        out.append(value)
    if pos != end:
        raise ProtocolError("trailing bytes")
    return out


def decode_values(payload: bytes) -> list[bytes]:
    """The values of a MULTI_GET response."""
    return _guard(_values, payload, "multi_get")


def decode_keys(payload: bytes) -> list[str]:
    """The keys of a TIMEOUT payload (the keys still missing)."""
    return _guard(lambda data: [v.decode() for v in _values(data)], payload, "timeout")


def _items(payload: bytes) -> dict[str, bytes]:
    end = len(payload)
    (n,) = U32.unpack_from(payload, 0)
    pos = 4
    if n * 8 > end - pos:
        raise ProtocolError(f"item count {n} does not fit the frame")
    out = {}
    for _ in range(n):
        key, pos = _read_bytes(payload, pos, end, "key")
        value, pos = _read_bytes(payload, pos, end, "value")
        out[key.decode()] = value
    if pos != end:
        raise ProtocolError("trailing bytes")
    return out


def decode_items(payload: bytes) -> dict[str, bytes]:
    """The key -> value dict of a LIST_KEYS response."""
    return _guard(_items, payload, "list_keys")


def decode_u64(payload: bytes) -> int:
    if len(payload) != 8:
        raise ProtocolError(f"expected an 8-byte integer, got {len(payload)} bytes")
    return U64.unpack(payload)[0]


def decode_bool(payload: bytes) -> bool:
    if len(payload) != 1:
        raise ProtocolError(f"expected a 1-byte flag, got {len(payload)} bytes")
    return payload != b"\x00"
