"""Request codecs: the client's encoders and the server's argument decoders, one per opcode.

A request body is ``u8 op, u32 request id, arguments``. Decoding never trusts its input: a
malformed body raises :class:`~rdzv.kv.protocol.ProtocolError`. Part of
:mod:`rdzv.kv.protocol`.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

from ._wire import (
    BODY_HEAD,
    E_UNKNOWN_OP,
    E_VALUE,
    FLAG_BLOCKING,
    FLAG_EPHEMERAL,
    FLAG_QUIET,
    HEAD_SIZE,
    OP_ADD,
    OP_APPEND,
    OP_CHECK,
    OP_CLOSE_SESSION,
    OP_COMPARE_SET,
    OP_COUNT_KEYS,
    OP_DELETE,
    OP_GET,
    OP_LIST_KEYS,
    OP_MULTI_GET,
    OP_MULTI_SET,
    OP_MULTI_SET_IF,
    OP_NAMES,
    OP_NUM_KEYS,
    OP_PING,
    OP_REVISION,
    OP_SET,
    OP_WAIT,
    OP_WATCH,
    OP_WATCH_GET,
    ProtocolError,
    REQ_HEAD,
    U32,
    U8,
    _ADD,
    _CAS,
    _GET,
    _SET,
    _WAIT_MS,
    _WATCH,
    _frame,
    _need,
    _read_bytes,
    _strs,
)


# -- requests: encoders (client side) -----------------------------------------------------
_SET_pack = _SET.pack
_GET_pack = _GET.pack


def encode_ping(rid: int) -> bytes:
    return REQ_HEAD.pack(HEAD_SIZE, OP_PING, rid)


def encode_set(
    rid: int, key: bytes, value: bytes, ephemeral: bool = False, quiet: bool = False
) -> bytes:
    flags = (FLAG_EPHEMERAL if ephemeral else 0) | (FLAG_QUIET if quiet else 0)
    klen = len(key)
    return _SET_pack(10 + klen + len(value), OP_SET, rid, flags, klen) + key + value


def encode_get(rid: int, key: bytes, blocking: bool, wait: int = 0) -> bytes:
    klen = len(key)
    return _GET_pack(14 + klen, OP_GET, rid, blocking, wait, klen) + key


def encode_add(rid: int, key: bytes, amount: int) -> bytes:
    return _ADD.pack(17 + len(key), OP_ADD, rid, amount, len(key)) + key


def encode_compare_set(
    rid: int, key: bytes, expected: bytes, desired: bytes, ephemeral: bool = False
) -> bytes:
    size = 14 + len(key) + len(expected) + len(desired)
    head = _CAS.pack(size, OP_COMPARE_SET, rid, ephemeral, len(key), len(expected))
    return head + key + expected + desired


def encode_wait(rid: int, keys: Sequence[bytes], wait: int) -> bytes:
    return _frame(OP_WAIT, rid, _WAIT_MS.pack(wait) + _strs(keys))


def encode_check(rid: int, keys: Sequence[bytes]) -> bytes:
    return _frame(OP_CHECK, rid, _strs(keys))


def encode_delete(rid: int, key: bytes) -> bytes:
    return _frame(OP_DELETE, rid, key)


def encode_num_keys(rid: int) -> bytes:
    return REQ_HEAD.pack(HEAD_SIZE, OP_NUM_KEYS, rid)


def encode_multi_get(rid: int, keys: Sequence[bytes], wait: int) -> bytes:
    return _frame(OP_MULTI_GET, rid, _WAIT_MS.pack(wait) + _strs(keys))


def _pairs(keys: Sequence[bytes], values: Sequence[bytes]) -> bytes:
    if len(keys) != len(values):
        raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
    pack = U32.pack
    return pack(len(keys)) + b"".join(pack(len(k)) + k + pack(len(v)) + v for k, v in zip(keys, values))


def encode_multi_set(rid: int, keys: Sequence[bytes], values: Sequence[bytes]) -> bytes:
    return _frame(OP_MULTI_SET, rid, _pairs(keys, values))


def encode_multi_set_if(
    rid: int,
    conditions: Sequence[tuple[bytes, bytes | None]],
    keys: Sequence[bytes],
    values: Sequence[bytes],
) -> bytes:
    """MULTI_SET_IF: ``u32 n`` n x (key, ``u8 present``, value), then MULTI_SET's pairs."""
    pack = U32.pack
    conds = pack(len(conditions)) + b"".join(
        pack(len(k)) + k + (b"\0" + pack(0) if v is None else b"\1" + pack(len(v)) + v)
        for k, v in conditions
    )
    return _frame(OP_MULTI_SET_IF, rid, conds + _pairs(keys, values))


def encode_append(rid: int, key: bytes, value: bytes) -> bytes:
    return _frame(OP_APPEND, rid, U32.pack(len(key)) + key + value)


def encode_list_keys(rid: int, prefix: bytes) -> bytes:
    return _frame(OP_LIST_KEYS, rid, prefix)


def encode_count_keys(rid: int, prefix: bytes) -> bytes:
    return _frame(OP_COUNT_KEYS, rid, prefix)


def encode_revision(rid: int, path: bytes) -> bytes:
    return _frame(OP_REVISION, rid, path)


def encode_watch(rid: int, path: bytes, since: int, wait: int) -> bytes:
    return _WATCH.pack(17 + len(path), OP_WATCH, rid, since, wait) + path


def encode_watch_get(rid: int, path: bytes, since: int, wait: int, key: bytes) -> bytes:
    body = U32.pack(len(path)) + path + key
    return _WATCH.pack(17 + len(body), OP_WATCH_GET, rid, since, wait) + body


def encode_close_session(rid: int) -> bytes:
    return REQ_HEAD.pack(HEAD_SIZE, OP_CLOSE_SESSION, rid)


# -- requests: decoders (server side) -----------------------------------------------------
# Each takes the frame buffer and the span [pos, end) of the arguments (after op and id) and
# returns the arguments as a tuple. They raise ProtocolError, struct.error, UnicodeDecodeError;
# decode_args() turns the last two into ProtocolError.


def _read_key(buf: bytes, pos: int, end: int) -> tuple[str, int]:
    raw, pos = _read_bytes(buf, pos, end, "key")
    if not raw:
        raise ProtocolError("empty key", E_VALUE)
    return raw.decode(), pos


def _read_keys(buf: bytes, pos: int, end: int) -> tuple[list[str], int]:
    _need(pos + 4, end, "key count")
    (n,) = U32.unpack_from(buf, pos)
    pos += 4
    if n * 4 > end - pos:
        raise ProtocolError(f"key count {n} does not fit the frame")
    keys = []
    for _ in range(n):
        key, pos = _read_key(buf, pos, end)
        keys.append(key)
    return keys, pos


def _done(pos: int, end: int) -> None:
    if pos != end:
        raise ProtocolError(f"{end - pos} unexpected trailing byte(s) in request")


def _dec_empty(buf: bytes, pos: int, end: int) -> tuple:
    _done(pos, end)
    return ()


def _dec_set(buf: bytes, pos: int, end: int) -> tuple[str, bytes, bool]:
    # The hot path: bounds checked inline rather than by _need().
    if pos + 5 > end:
        _need(pos + 5, end, "set header")
    flags, klen = _SET_ARGS_unpack_from(buf, pos)
    kend = pos + 5 + klen
    if kend > end or not klen:
        _need(kend, end, "key")
        raise ProtocolError("empty key", E_VALUE)
    return buf[pos + 5 : kend].decode(), buf[kend:end], bool(flags & FLAG_EPHEMERAL)


def _dec_get(buf: bytes, pos: int, end: int) -> tuple[str, bool, int]:
    if pos + 9 > end:
        _need(pos + 9, end, "get header")
    flags, wait, klen = _GET_ARGS_unpack_from(buf, pos)
    kend = pos + 9 + klen
    if kend != end:
        raise ProtocolError("key length does not match the frame")
    if not klen:
        raise ProtocolError("empty key", E_VALUE)
    return buf[pos + 9 : kend].decode(), bool(flags & FLAG_BLOCKING), wait


def _dec_add(buf: bytes, pos: int, end: int) -> tuple[str, int]:
    _need(pos + 12, end, "add header")
    amount, klen = _ADD_ARGS.unpack_from(buf, pos)
    kend = pos + 12 + klen
    if kend != end:
        raise ProtocolError("key length does not match the frame")
    if klen == 0:
        raise ProtocolError("empty key", E_VALUE)
    return buf[pos + 12 : kend].decode(), amount


def _dec_compare_set(buf: bytes, pos: int, end: int) -> tuple[str, bytes, bytes, bool]:
    _need(pos + 9, end, "compare_set header")
    flags, klen, elen = _CAS_ARGS.unpack_from(buf, pos)
    kend = pos + 9 + klen
    eend = kend + elen
    _need(eend, end, "expected value")
    if klen == 0:
        raise ProtocolError("empty key", E_VALUE)
    key = buf[pos + 9 : kend].decode()
    return key, buf[kend:eend], buf[eend:end], bool(flags & FLAG_EPHEMERAL)


def _dec_wait(buf: bytes, pos: int, end: int) -> tuple[list[str], int]:
    _need(pos + 4, end, "wait time")
    (wait,) = U32.unpack_from(buf, pos)
    keys, pos = _read_keys(buf, pos + 4, end)
    _done(pos, end)
    return keys, wait


def _dec_keys(buf: bytes, pos: int, end: int) -> tuple[list[str]]:
    keys, pos = _read_keys(buf, pos, end)
    _done(pos, end)
    return (keys,)


def _dec_rest_key(buf: bytes, pos: int, end: int) -> tuple[str]:
    if pos >= end:
        raise ProtocolError("empty key", E_VALUE)
    return (buf[pos:end].decode(),)


def _dec_rest_str(buf: bytes, pos: int, end: int) -> tuple[str]:
    return (buf[pos:end].decode(),)


def _dec_multi_set(buf: bytes, pos: int, end: int) -> tuple[list[str], list[bytes]]:
    _need(pos + 4, end, "pair count")
    (n,) = U32.unpack_from(buf, pos)
    pos += 4
    if n * 8 > end - pos:
        raise ProtocolError(f"pair count {n} does not fit the frame")
    keys, values = [], []
    for _ in range(n):
        key, pos = _read_key(buf, pos, end)
        value, pos = _read_bytes(buf, pos, end, "value")
        keys.append(key)
        values.append(value)
    _done(pos, end)
    return keys, values


def _dec_multi_set_if(
    buf: bytes, pos: int, end: int
) -> tuple[dict[str, bytes | None], list[str], list[bytes]]:
    _need(pos + 4, end, "condition count")
    (n,) = U32.unpack_from(buf, pos)
    pos += 4
    if n * 9 > end - pos:
        raise ProtocolError(f"condition count {n} does not fit the frame")
    conditions: dict[str, bytes | None] = {}
    for _ in range(n):
        key, pos = _read_key(buf, pos, end)
        _need(pos + 1, end, "condition flag")
        (present,) = U8.unpack_from(buf, pos)
        value, pos = _read_bytes(buf, pos + 1, end, "condition value")
        conditions[key] = value if present else None
    if not conditions:
        raise ProtocolError("multi_set_if without a condition", E_VALUE)
    keys, values = _dec_multi_set(buf, pos, end)
    return conditions, keys, values


def _dec_append(buf: bytes, pos: int, end: int) -> tuple[str, bytes]:
    key, pos = _read_key(buf, pos, end)
    return key, buf[pos:end]


def _dec_watch(buf: bytes, pos: int, end: int) -> tuple[str, int, int]:
    _need(pos + 12, end, "watch header")
    since, wait = _WATCH_ARGS.unpack_from(buf, pos)
    return buf[pos + 12 : end].decode(), since, wait


def _dec_watch_get(buf: bytes, pos: int, end: int) -> tuple[str, str, int, int]:
    _need(pos + 12, end, "watch_get header")
    since, wait = _WATCH_ARGS.unpack_from(buf, pos)
    path, pos = _read_bytes(buf, pos + 12, end, "watch_get path")
    if pos == end:
        raise ProtocolError("empty key", E_VALUE)
    return path.decode(), buf[pos:end].decode(), since, wait


_SET_ARGS = struct.Struct("<BI")
_SET_ARGS_unpack_from = _SET_ARGS.unpack_from
_GET_ARGS = struct.Struct("<BII")
_GET_ARGS_unpack_from = _GET_ARGS.unpack_from
_ADD_ARGS = struct.Struct("<qI")
_CAS_ARGS = struct.Struct("<BII")
_WATCH_ARGS = struct.Struct("<QI")

DECODERS: dict[int, Callable[[bytes, int, int], tuple]] = {
    OP_PING: _dec_empty,
    OP_SET: _dec_set,
    OP_GET: _dec_get,
    OP_ADD: _dec_add,
    OP_COMPARE_SET: _dec_compare_set,
    OP_WAIT: _dec_wait,
    OP_CHECK: _dec_keys,
    OP_DELETE: _dec_rest_key,
    OP_NUM_KEYS: _dec_empty,
    OP_MULTI_GET: _dec_wait,
    OP_MULTI_SET: _dec_multi_set,
    OP_APPEND: _dec_append,
    OP_LIST_KEYS: _dec_rest_str,
    OP_COUNT_KEYS: _dec_rest_str,
    OP_REVISION: _dec_rest_str,
    OP_WATCH: _dec_watch,
    OP_CLOSE_SESSION: _dec_empty,
    OP_WATCH_GET: _dec_watch_get,
    OP_MULTI_SET_IF: _dec_multi_set_if,
}
"""Argument decoder per opcode: ``decoder(buf, pos, end) -> args``."""


def decode_args(op: int, buf: bytes, pos: int, end: int) -> tuple:
    """The arguments of a request with opcode ``op`` in ``buf[pos:end]``; ProtocolError if bad."""
    decoder = DECODERS.get(op)
    if decoder is None:
        raise ProtocolError(f"unknown opcode {op}", E_UNKNOWN_OP)
    try:
        return decoder(buf, pos, end)
    except struct.error as exc:
        raise ProtocolError(f"malformed {OP_NAMES[op]} request: {exc}") from None
    except UnicodeDecodeError:
        raise ProtocolError(f"malformed {OP_NAMES[op]} request: a key is not valid UTF-8") from None


def decode_request(body: bytes) -> tuple[int, int, tuple]:
    """(op, request id, args) of a request body (the frame without its length prefix)."""
    if len(body) < HEAD_SIZE:
        raise ProtocolError(f"request of {len(body)} bytes is shorter than its header")
    op, rid = BODY_HEAD.unpack_from(body, 0)
    return op, rid, decode_args(op, body, HEAD_SIZE, len(body))
