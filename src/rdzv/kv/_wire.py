"""The protocol's vocabulary: constants, opcodes, error codes, structs, framing helpers.

Every message is a *frame*: a little-endian ``u32`` body length, then the body. Strings and byte
strings inside a body are ``u32`` length + bytes, except that the last field of a body may take
"the rest of the frame". Part of :mod:`rdzv.kv.protocol` (spec: ``docs/protocol.md``).
"""

from __future__ import annotations

import struct
from typing import Sequence

from ..errors import StoreProtocolError

MAGIC = b"RDZV"
PROTOCOL_VERSION = 2
"""2: a session is resumed with the random token its WELCOME gave (version 1: by its id alone)."""
DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
HANDSHAKE_MAX_FRAME = 4096
"""Handshake frames are small; a longer one is garbage (or not an rdzv peer)."""
NONCE_SIZE = 32
MAC_SIZE = 32
TOKEN_SIZE = 16
"""Bytes of a session's resume token (random, given by the server at the session's creation)."""

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
OP_WATCH_GET = 18
OP_MULTI_SET_IF = 19

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
    OP_WATCH_GET: "watch_get",
    OP_MULTI_SET_IF: "multi_set_if",
}

MUTATING_OPS = frozenset(
    {OP_SET, OP_ADD, OP_COMPARE_SET, OP_DELETE, OP_MULTI_SET, OP_APPEND, OP_MULTI_SET_IF}
)
"""Writes: the server keeps the highest request id applied per session (and its answer), so that
a request resent after a reconnect (same session, id not above it) is not applied twice."""
PIPELINED_OPS = frozenset({OP_SET, OP_MULTI_SET})
"""Void writes a client may send without waiting for their answer (the answer is empty)."""
RESENDABLE_AFTER_EXPIRY = (
    frozenset(range(256)) - MUTATING_OPS - {OP_CLOSE_SESSION} | {OP_MULTI_SET_IF}
)
"""Requests a client may send again in a new session when it cannot know whether its expired
session applied them: reads, and conditional writes (their conditions are checked again, and
one on a key of the expired session fails); not a close of the session (it would close the
new one). Any other write may be applied twice, or act on a
state that others changed once the session expired (docs/protocol.md, "Session expiry")."""

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
E_BUSY = 9

ERROR_NAMES = {
    E_BAD_REQUEST: "bad request",
    E_UNKNOWN_OP: "unknown opcode",
    E_VALUE: "invalid value",
    E_FRAME_TOO_LARGE: "frame too large",
    E_VERSION: "protocol version mismatch",
    E_AUTH: "authentication failed",
    E_INTERNAL: "internal server error",
    E_SESSION: "session error",
    E_BUSY: "server memory budget exceeded",
}

HS_OK = 0
HS_VERSION_MISMATCH = 1
HS_AUTH_FAILED = 2


class ProtocolError(StoreProtocolError):
    """Malformed or unexpected data on the wire; ``code`` is the error code to answer with."""

    code: int

    def __init__(self, message: str, code: int = E_BAD_REQUEST) -> None:
        super().__init__(message, code)


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
_HELLO = struct.Struct("<4sHHdQ16s16s")  # magic, version, flags, ttl, resume, token, nonce
_CHALLENGE = struct.Struct("<4sHBB")
_WELCOME = struct.Struct("<BQBId16s")  # status, session, resumed, max frame, ttl, token
_ERROR = struct.Struct("<IBIH")  # len, status, rid, code

MAX_WAIT_MS = 0xFFFFFFFF


# -- encoding and decoding helpers -------------------------------------------------------------
def _strs(items: Sequence[bytes]) -> bytes:
    pack = U32.pack
    return U32.pack(len(items)) + b"".join(pack(len(b)) + b for b in items)


def _frame(op: int, rid: int, body: bytes) -> bytes:
    return REQ_HEAD.pack(HEAD_SIZE + len(body), op, rid) + body


def resendable_after_expiry(frame: bytes) -> bool:
    """Whether request ``frame`` may be sent again in a new session (its op, byte 4, is in
    :data:`RESENDABLE_AFTER_EXPIRY`)."""
    return frame[4] in RESENDABLE_AFTER_EXPIRY


def wait_ms(seconds: float) -> int:
    """A wait in seconds as the protocol's u32 milliseconds (rounded up, clamped)."""
    if seconds <= 0:
        return 0
    return min(MAX_WAIT_MS, int(seconds * 1000.0 + 0.999))


def frame(body: bytes) -> bytes:
    """``body`` with its length prefix."""
    return LEN.pack(len(body)) + body


def _need(pos: int, end: int, what: str) -> None:
    if pos > end:
        raise ProtocolError(f"truncated request: {what} runs past the end of the frame")


def _read_bytes(buf: bytes, pos: int, end: int, what: str) -> tuple[bytes, int]:
    _need(pos + 4, end, what)
    (n,) = U32.unpack_from(buf, pos)
    stop = pos + 4 + n
    _need(stop, end, what)
    return buf[pos + 4 : stop], stop
