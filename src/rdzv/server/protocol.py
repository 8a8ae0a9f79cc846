"""The store's wire protocol: a pure codec (bytes in, values out), no I/O. Spec: ``docs/protocol.md``.

Every message is a *frame*: a little-endian ``u32`` body length, then the body. A connection
starts with a handshake (HELLO, CHALLENGE, AUTH, WELCOME), then carries requests
(``u8 op, u32 request id, arguments``) and responses (``u8 status, u32 request id, payload``).
Strings and byte strings inside a body are ``u32`` length + bytes, except that the last field of
a body may take "the rest of the frame". Keys are UTF-8.

Decoding never trusts its input: any malformed body raises :class:`ProtocolError` (a
:class:`~rdzv.errors.StoreProtocolError`), never another exception.
"""

from __future__ import annotations

import struct
from typing import Callable, NamedTuple, Sequence

from ..errors import StoreProtocolError

MAGIC = b"RDZV"
PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
HANDSHAKE_MAX_FRAME = 4096
"""Handshake frames are small; a longer one is garbage (or not an rdzv peer)."""
NONCE_SIZE = 32
MAC_SIZE = 32

# -- opcodes ------------------------------------------------------------------------------------
OP_PING = 1
OP_SET = 2
OP_GET = 3
OP_ADD = 4
OP_COMPARE_SET = 5
OP_WAIT = 6
OP_CHECK = 7
OP_DELETE = 8
OP_NUM_KEYS = 9
OP_MULTI_GET = 10
OP_MULTI_SET = 11
OP_APPEND = 12
OP_LIST_KEYS = 13
OP_COUNT_KEYS = 14
OP_REVISION = 15
OP_WATCH = 16
OP_CLOSE_SESSION = 17

OP_NAMES = {
    OP_PING: "ping",
    OP_SET: "set",
    OP_GET: "get",
    OP_ADD: "add",
    OP_COMPARE_SET: "compare_set",
    OP_WAIT: "wait",
    OP_CHECK: "check",
    OP_DELETE: "delete",
    OP_NUM_KEYS: "num_keys",
    OP_MULTI_GET: "multi_get",
    OP_MULTI_SET: "multi_set",
    OP_APPEND: "append",
    OP_LIST_KEYS: "list_keys",
    OP_COUNT_KEYS: "count_keys",
    OP_REVISION: "revision",
    OP_WATCH: "watch",
    OP_CLOSE_SESSION: "close_session",
}

MUTATING_OPS = frozenset({OP_SET, OP_ADD, OP_COMPARE_SET, OP_DELETE, OP_MULTI_SET, OP_APPEND})
"""Writes: the server keeps the highest request id applied per session (and its answer), so that
a request resent after a reconnect (same session, id not above it) is not applied twice."""
PIPELINED_OPS = frozenset({OP_SET, OP_MULTI_SET})
"""Void writes a client may send without waiting for their answer (the answer is empty)."""

FLAG_EPHEMERAL = 1
"""SET / COMPARE_SET flag: the key belongs to the sender's session."""
FLAG_QUIET = 2
"""SET flag: answer only if the write fails (no OK); a later answer on the connection implies it
was applied, as requests of one connection are applied and answered in order."""
FLAG_BLOCKING = 1
"""GET flag: wait up to ``wait_ms`` for the key (else answer at once, with a found byte)."""
HELLO_FLAG_HAS_SECRET = 1
CHALLENGE_FLAG_AUTH_REQUIRED = 1

# -- response statuses and error codes ------------------------------------------------------
STATUS_OK = 0
STATUS_ERROR = 1
STATUS_TIMEOUT = 2

E_BAD_REQUEST = 1
E_UNKNOWN_OP = 2
E_VALUE = 3
E_FRAME_TOO_LARGE = 4
E_VERSION = 5
E_AUTH = 6
E_INTERNAL = 7
E_SESSION = 8

ERROR_NAMES = {
    E_BAD_REQUEST: "bad request",
    E_UNKNOWN_OP: "unknown opcode",
    E_VALUE: "invalid value",
    E_FRAME_TOO_LARGE: "frame too large",
    E_VERSION: "protocol version mismatch",
    E_AUTH: "authentication failed",
    E_INTERNAL: "internal server error",
    E_SESSION: "session error",
}

HS_OK = 0
HS_VERSION_MISMATCH = 1
HS_AUTH_FAILED = 2


class ProtocolError(StoreProtocolError):
    """Malformed or unexpected data on the wire; ``code`` is the error code to answer with."""

    def __init__(self, message: str, code: int = E_BAD_REQUEST) -> None:
        super().__init__(message)
        self.code = code


# -- structs ------------------------------------------------------------------------------------
U8 = struct.Struct("<B")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
LEN = U32
REQ_HEAD = struct.Struct("<IBI")
"""Frame length, op, request id: the first 9 bytes of a request frame."""
RESP_HEAD = struct.Struct("<IBI")
"""Frame length, status, request id: the first 9 bytes of a response frame."""
BODY_HEAD = struct.Struct("<BI")
"""op (or status) and request id at the start of a body."""
HEAD_SIZE = 5
"""Size of BODY_HEAD: a request/response body is never shorter."""

_SET = struct.Struct("<IBIBI")  # len, op, rid, flags, klen
_GET = struct.Struct("<IBIBII")  # len, op, rid, flags, wait_ms, klen
_ADD = struct.Struct("<IBIqI")  # len, op, rid, amount, klen
_CAS = struct.Struct("<IBIBII")  # len, op, rid, flags, klen, elen
_WAIT_MS = struct.Struct("<I")
_WATCH = struct.Struct("<IBIQI")  # len, op, rid, since, wait_ms
_HELLO = struct.Struct("<4sHHdQ16s")
_CHALLENGE = struct.Struct("<4sHBB")
_WELCOME = struct.Struct("<BQBId")
_ERROR = struct.Struct("<IBIH")  # len, status, rid, code

MAX_WAIT_MS = 0xFFFFFFFF


# -- encoding helpers -----------------------------------------------------------------------
def _key(key: str) -> bytes:
    return key.encode()


def _strs(items: Sequence[bytes]) -> bytes:
    pack = U32.pack
    return U32.pack(len(items)) + b"".join(pack(len(b)) + b for b in items)


def _frame(op: int, rid: int, body: bytes) -> bytes:
    return REQ_HEAD.pack(HEAD_SIZE + len(body), op, rid) + body


def wait_ms(seconds: float) -> int:
    """A wait in seconds as the protocol's u32 milliseconds (rounded up, clamped)."""
    if seconds <= 0:
        return 0
    return min(MAX_WAIT_MS, int(seconds * 1000.0 + 0.999))


# -- requests: encoders (client side) -----------------------------------------------------
def encode_ping(rid: int) -> bytes:
    return REQ_HEAD.pack(HEAD_SIZE, OP_PING, rid)


def encode_set(
    rid: int, key: bytes, value: bytes, ephemeral: bool = False, quiet: bool = False
) -> bytes:
    flags = (FLAG_EPHEMERAL if ephemeral else 0) | (FLAG_QUIET if quiet else 0)
    return _SET.pack(10 + len(key) + len(value), OP_SET, rid, flags, len(key)) + key + value


def encode_get(rid: int, key: bytes, blocking: bool, wait: int = 0) -> bytes:
    return _GET.pack(14 + len(key), OP_GET, rid, blocking, wait, len(key)) + key


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


def encode_multi_set(rid: int, keys: Sequence[bytes], values: Sequence[bytes]) -> bytes:
    if len(keys) != len(values):
        raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
    pack = U32.pack
    body = U32.pack(len(keys)) + b"".join(
        pack(len(k)) + k + pack(len(v)) + v for k, v in zip(keys, values)
    )
    return _frame(OP_MULTI_SET, rid, body)


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


def encode_close_session(rid: int) -> bytes:
    return REQ_HEAD.pack(HEAD_SIZE, OP_CLOSE_SESSION, rid)


# -- requests: decoders (server side) -----------------------------------------------------
# Each takes the frame buffer and the span [pos, end) of the arguments (after op and id) and
# returns the arguments as a tuple. They raise ProtocolError, struct.error, UnicodeDecodeError;
# decode_args() turns the last two into ProtocolError.


def _need(pos: int, end: int, what: str) -> None:
    if pos > end:
        raise ProtocolError(f"truncated request: {what} runs past the end of the frame")


def _read_bytes(buf: bytes, pos: int, end: int, what: str) -> tuple[bytes, int]:
    _need(pos + 4, end, what)
    (n,) = U32.unpack_from(buf, pos)
    stop = pos + 4 + n
    _need(stop, end, what)
    return buf[pos + 4 : stop], stop


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
    _need(pos + 5, end, "set header")
    flags, klen = _SET_ARGS.unpack_from(buf, pos)
    kend = pos + 5 + klen
    _need(kend, end, "key")
    if klen == 0:
        raise ProtocolError("empty key", E_VALUE)
    return buf[pos + 5 : kend].decode(), buf[kend:end], bool(flags & FLAG_EPHEMERAL)


def _dec_get(buf: bytes, pos: int, end: int) -> tuple[str, bool, int]:
    _need(pos + 9, end, "get header")
    flags, wait, klen = _GET_ARGS.unpack_from(buf, pos)
    kend = pos + 9 + klen
    if kend != end:
        raise ProtocolError("key length does not match the frame")
    if klen == 0:
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


def _dec_append(buf: bytes, pos: int, end: int) -> tuple[str, bytes]:
    key, pos = _read_key(buf, pos, end)
    return key, buf[pos:end]


def _dec_watch(buf: bytes, pos: int, end: int) -> tuple[str, int, int]:
    _need(pos + 12, end, "watch header")
    since, wait = _WATCH_ARGS.unpack_from(buf, pos)
    return buf[pos + 12 : end].decode(), since, wait


_SET_ARGS = struct.Struct("<BI")
_GET_ARGS = struct.Struct("<BII")
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


# -- handshake ------------------------------------------------------------------------------
class Hello(NamedTuple):
    version: int
    flags: int
    ttl: float
    resume_session: int
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
    proof: bytes
    message: str


def frame(body: bytes) -> bytes:
    """``body`` with its length prefix."""
    return LEN.pack(len(body)) + body


def encode_hello(ttl: float, resume_session: int, nonce: bytes, has_secret: bool) -> bytes:
    flags = HELLO_FLAG_HAS_SECRET if has_secret else 0
    return frame(_HELLO.pack(MAGIC, PROTOCOL_VERSION, flags, ttl, resume_session, nonce))


def decode_hello(body: bytes) -> Hello:
    """The HELLO of a client. A peer of another protocol version gets a Hello whose fields
    after ``version`` are empty (the server answers with a version mismatch)."""
    if len(body) < 6 or body[:4] != MAGIC:
        raise ProtocolError("not an rdzv store client (bad handshake magic)")
    (version,) = struct.unpack_from("<H", body, 4)
    if version != PROTOCOL_VERSION:
        return Hello(version, 0, 0.0, 0, b"")
    if len(body) != _HELLO.size:
        raise ProtocolError(f"malformed HELLO of {len(body)} bytes")
    _, version, flags, ttl, resume, nonce = _HELLO.unpack(body)
    if not ttl >= 0.0 or ttl == float("inf"):  # also rejects NaN
        raise ProtocolError(f"invalid session ttl {ttl!r} in HELLO")
    return Hello(version, flags, ttl, resume, nonce)


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
    proof: bytes = b"",
    message: str = "",
) -> bytes:
    if status != HS_OK:
        return frame(U8.pack(status) + message.encode("utf-8", "replace"))
    return frame(_WELCOME.pack(status, session, resumed, max_frame_size, ttl) + proof)


def decode_welcome(body: bytes) -> Welcome:
    if not body:
        raise ProtocolError("empty WELCOME")
    status = body[0]
    if status != HS_OK:
        return Welcome(status, 0, False, 0, 0.0, b"", body[1:].decode("utf-8", "replace"))
    if len(body) not in (_WELCOME.size, _WELCOME.size + MAC_SIZE):
        raise ProtocolError(f"malformed WELCOME of {len(body)} bytes")
    status, session, resumed, max_frame, ttl = _WELCOME.unpack_from(body, 0)
    return Welcome(status, session, bool(resumed), max_frame, ttl, body[_WELCOME.size :], "")
