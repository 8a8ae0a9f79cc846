"""One binary encoding of the state's effects, written by the server's log and by the FileStore.

An effect is a type byte, a fixed head, then its text or bytes, which run to the end of the
effect (its container frames it: a log record, a length-prefixed item of a FileStore record):

* ``Put``: ``u8 1, u64 revision, u64 session, u32 key length``, the key, the value;
* ``Delete``: ``u8 2, u64 revision``, the key;
* ``SessionOpen``: ``u8 3, u64 session, f64 ttl``, the resume token (empty for a FileStore's);
* ``SessionClose``: ``u8 4, u64 session``.

Keys are UTF-8 (lone surrogates kept). Types from :data:`FIRST_FORMAT_TYPE` on are free for a
format's own records (a snapshot's counters, a log's request marks). No I/O here.
"""

from __future__ import annotations

import struct

from ._state import Delete, Effect, Put, SessionClose, SessionOpen

PUT, DELETE, SESSION_OPEN, SESSION_CLOSE = range(1, 5)
FIRST_FORMAT_TYPE = 5
"""The first type byte a format may give a record of its own."""

_PUT_HEAD = struct.Struct("<BQQI")  # type, revision, session, key length; then key, value
_TYPE_NUMBER = struct.Struct("<BQ")  # type, revision (Delete) or session (SessionClose)
_SESSION_OPEN_HEAD = struct.Struct("<BQd")  # type, session, ttl; then the token


def encode_key(value: str) -> bytes:
    """A key or path as an effect stores it."""
    return value.encode("utf-8", "surrogatepass")


def decode_key(data: bytes) -> str:
    return data.decode("utf-8", "surrogatepass")


def encode_effect(effect: Effect) -> bytes:
    """The bytes of one effect (not framed: its container says where it ends)."""
    if isinstance(effect, Put):
        key = encode_key(effect.key)
        return _PUT_HEAD.pack(PUT, effect.revision, effect.session, len(key)) + key + effect.value
    if isinstance(effect, Delete):
        return _TYPE_NUMBER.pack(DELETE, effect.revision) + encode_key(effect.key)
    if isinstance(effect, SessionOpen):
        return _SESSION_OPEN_HEAD.pack(SESSION_OPEN, effect.session, effect.ttl) + effect.token
    if isinstance(effect, SessionClose):
        return _TYPE_NUMBER.pack(SESSION_CLOSE, effect.session)
    raise TypeError(f"not an effect: {effect!r} (a Put, Delete, SessionOpen or SessionClose)")


def decode_effect(data: bytes) -> Effect:
    """The effect ``data`` holds in full; ValueError (or struct.error) if it makes no sense."""
    kind = data[0] if data else None
    if kind == PUT:
        _, revision, session, key_length = _PUT_HEAD.unpack_from(data)
        key_end = _PUT_HEAD.size + key_length
        if key_end > len(data):
            raise ValueError(f"key length {key_length} runs past the effect")
        return Put(revision, decode_key(data[_PUT_HEAD.size : key_end]), data[key_end:], session)
    if kind == DELETE:
        return Delete(_TYPE_NUMBER.unpack_from(data)[1], decode_key(data[_TYPE_NUMBER.size :]))
    if kind == SESSION_OPEN:
        _, session, ttl = _SESSION_OPEN_HEAD.unpack_from(data)
        return SessionOpen(session, ttl, data[_SESSION_OPEN_HEAD.size :])
    if kind == SESSION_CLOSE:
        return SessionClose(_TYPE_NUMBER.unpack(data)[1])
    raise ValueError(f"unknown effect type {kind}")


def is_effect(data: bytes) -> bool:
    """Whether ``data`` starts with an effect's type (else: a format's own record)."""
    return bool(data) and PUT <= data[0] < FIRST_FORMAT_TYPE
