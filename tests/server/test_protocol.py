"""The wire codec: every request round-trips, and garbage raises ProtocolError, never crashes."""

from __future__ import annotations

import random
import struct

import pytest

from rdzv.errors import StoreProtocolError
from rdzv.kv import protocol as P

REQUESTS = [
    (P.encode_ping(1), P.OP_PING, ()),
    (P.encode_set(2, b"k", b"v"), P.OP_SET, ("k", b"v", False)),
    (P.encode_set(3, "ü/k".encode(), b"", True), P.OP_SET, ("ü/k", b"", True)),
    (P.encode_get(4, b"k", False), P.OP_GET, ("k", False, 0)),
    (P.encode_get(5, b"k", True, 1234), P.OP_GET, ("k", True, 1234)),
    (P.encode_add(6, b"n", -(2**63)), P.OP_ADD, ("n", -(2**63))),
    (P.encode_compare_set(7, b"k", b"old", b"new", True), P.OP_COMPARE_SET, ("k", b"old", b"new", True)),
    (P.encode_wait(8, [b"a", b"b"], 99), P.OP_WAIT, (["a", "b"], 99)),
    (P.encode_check(9, [b"a"]), P.OP_CHECK, (["a"],)),
    (P.encode_delete(10, b"gone"), P.OP_DELETE, ("gone",)),
    (P.encode_num_keys(11), P.OP_NUM_KEYS, ()),
    (P.encode_multi_get(12, [b"x", b"y"], 0), P.OP_MULTI_GET, (["x", "y"], 0)),
    (P.encode_multi_set(13, [b"x", b"y"], [b"1", b""]), P.OP_MULTI_SET, (["x", "y"], [b"1", b""])),
    (P.encode_append(14, b"k", b"tail"), P.OP_APPEND, ("k", b"tail")),
    (P.encode_list_keys(15, b"dir/"), P.OP_LIST_KEYS, ("dir/",)),
    (P.encode_count_keys(16, b""), P.OP_COUNT_KEYS, ("",)),
    (P.encode_revision(17, b"a/b"), P.OP_REVISION, ("a/b",)),
    (P.encode_watch(18, b"d/", 2**64 - 1, 5000), P.OP_WATCH, ("d/", 2**64 - 1, 5000)),
    (P.encode_close_session(19), P.OP_CLOSE_SESSION, ()),
    (P.encode_watch_get(20, b"d/", 7, 0, "d/ü".encode()), P.OP_WATCH_GET, ("d/", "d/ü", 7, 0)),
    (P.encode_multi_set_if(21, [(b"lock", b"me"), (b"st", None), (b"e", b"")], [b"x"], [b"1"]),
     P.OP_MULTI_SET_IF, ({"lock": b"me", "st": None, "e": b""}, ["x"], [b"1"])),
    (P.encode_multi_set_if(22, [(b"lock", b"me")], [], []), P.OP_MULTI_SET_IF,
     ({"lock": b"me"}, [], [])),
]


@pytest.mark.parametrize("frame, op, args", REQUESTS, ids=[P.OP_NAMES[r[1]] for r in REQUESTS])
def test_request_round_trip(frame: bytes, op: int, args: tuple) -> None:
    (length,) = P.LEN.unpack_from(frame)
    assert length == len(frame) - 4
    got_op, rid, got_args = P.decode_request(frame[4:])
    assert (got_op, got_args) == (op, args)
    assert rid > 0


def test_every_opcode_has_an_encoder_in_the_table() -> None:
    assert {r[1] for r in REQUESTS} == set(P.OP_NAMES) == set(P.DECODERS)


def test_responses_round_trip() -> None:
    status, rid, payload = P.decode_response(P.ok(7, b"data")[4:])
    assert (status, rid, payload) == (P.STATUS_OK, 7, b"data")
    status, rid, payload = P.decode_response(P.error(8, P.E_VALUE, "bad ü")[4:])
    assert (status, rid) == (P.STATUS_ERROR, 8)
    assert P.decode_error(payload) == (P.E_VALUE, "bad ü")
    status, rid, payload = P.decode_response(P.timeout(9, ["a", "b/c"])[4:])
    assert (status, rid, P.decode_keys(payload)) == (P.STATUS_TIMEOUT, 9, ["a", "b/c"])
    assert P.decode_values(P.payload_values([b"1", b""])) == [b"1", b""]
    assert P.decode_items(P.payload_items({"a": b"1", "ü": b"2"})) == {"a": b"1", "ü": b"2"}
    assert P.decode_u64(P.payload_u64(2**64 - 1)) == 2**64 - 1
    assert P.decode_watch_get(P.payload_watch_get(3, None)) == (3, None)
    assert P.decode_watch_get(P.payload_watch_get(4, b"")) == (4, b"")
    with pytest.raises(P.ProtocolError, match="malformed watch_get"):
        P.decode_watch_get(b"\x01")
    with pytest.raises(P.ProtocolError, match="empty key"):
        P.decode_request(P.encode_watch_get(21, b"d/", 0, 0, b"")[4:])


def test_handshake_round_trip() -> None:
    nonce, token = bytes(range(16)), bytes(range(16, 32))
    hello = P.decode_hello(P.encode_hello(2.5, 42, token, nonce, True)[4:])
    assert hello == P.Hello(P.PROTOCOL_VERSION, P.HELLO_FLAG_HAS_SECRET, 2.5, 42, token, nonce)
    fresh = P.decode_hello(P.encode_hello(2.5, 0, token, nonce, False)[4:])
    assert fresh.resume_token == bytes(P.TOKEN_SIZE)  # no session named: no token sent
    snonce = bytes(32)
    challenge = P.decode_challenge(P.encode_challenge(P.HS_OK, True, snonce)[4:])
    assert challenge.auth_required and challenge.nonce == snonce
    refused = P.decode_challenge(P.encode_challenge(P.HS_VERSION_MISMATCH, False, message="v9")[4:])
    assert refused.status == P.HS_VERSION_MISMATCH and refused.message == "v9"
    welcome = P.decode_welcome(
        P.encode_welcome(P.HS_OK, 5, True, 1 << 20, 2.0, b"t" * 16, b"p" * 32)[4:]
    )
    assert welcome == P.Welcome(P.HS_OK, 5, True, 1 << 20, 2.0, b"t" * 16, b"p" * 32, "")
    failed = P.decode_welcome(P.encode_welcome(P.HS_AUTH_FAILED, message="no")[4:])
    assert failed.status == P.HS_AUTH_FAILED and failed.message == "no"


def test_hello_of_another_version_is_recognised() -> None:
    body = P.MAGIC + struct.pack("<H", P.PROTOCOL_VERSION + 1) + b"whatever follows"
    assert P.decode_hello(body).version == P.PROTOCOL_VERSION + 1


@pytest.mark.parametrize(
    "body",
    [b"", b"RDZ", b"HTTP/1.1 GET /", P.MAGIC + b"\x01", P.encode_hello(1.0, 0, b"", bytes(16), False)[4:-1]],
)
def test_bad_hello_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_hello(body)


def test_nan_ttl_is_refused() -> None:
    with pytest.raises(P.ProtocolError, match="ttl"):
        P.decode_hello(P.encode_hello(float("nan"), 0, b"", bytes(16), False)[4:])


@pytest.mark.parametrize(
    "body, message",
    [
        (struct.pack("<BI", 200, 1), "unknown opcode"),
        (struct.pack("<BI", P.OP_SET, 1) + b"\x00\xff\xff\xff\xff", "past the end"),
        (struct.pack("<BI", P.OP_SET, 1) + b"\x00\x00\x00\x00\x00", "empty key"),
        (struct.pack("<BI", P.OP_GET, 1) + b"\x01", "truncated"),
        (struct.pack("<BI", P.OP_PING, 1) + b"extra", "trailing"),
        (struct.pack("<BI", P.OP_CHECK, 1) + struct.pack("<I", 10**9), "does not fit"),
        (struct.pack("<BI", P.OP_DELETE, 1) + b"\xff\xfe", "UTF-8"),
        (b"\x02", "shorter than its header"),
        (struct.pack("<BII", P.OP_MULTI_SET_IF, 1, 0) + struct.pack("<I", 0), "without a condition"),
        (struct.pack("<BII", P.OP_MULTI_SET_IF, 1, 10**9), "does not fit"),
        (P.encode_multi_set_if(1, [(b"k", b"v")], [b"x"], [b"1"])[4:-1], "past the end"),
    ],
)
def test_malformed_requests_name_the_problem(body: bytes, message: str) -> None:
    with pytest.raises(P.ProtocolError, match=message):
        P.decode_request(body)


def test_protocol_error_is_a_store_protocol_error() -> None:
    assert issubclass(P.ProtocolError, StoreProtocolError)


def test_fuzzed_requests_raise_only_protocol_errors() -> None:
    rng = random.Random(1234)
    valid = [r[0][4:] for r in REQUESTS]
    for _ in range(20000):
        base = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            action = rng.random()
            if action < 0.4 and base:
                base[rng.randrange(len(base))] = rng.randrange(256)
            elif action < 0.7 and base:
                del base[rng.randrange(len(base)) :]
            else:
                base += bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            P.decode_request(bytes(base))
        except P.ProtocolError:
            pass


def test_fuzzed_responses_raise_only_protocol_errors() -> None:
    rng = random.Random(99)
    payloads = [P.payload_values([b"a", b"bc"]), P.payload_items({"k": b"v"}), P.payload_u64(3)]
    decoders = [P.decode_values, P.decode_items, P.decode_keys, P.decode_u64, P.decode_bool]
    for _ in range(5000):
        data = bytearray(rng.choice(payloads))
        if data and rng.random() < 0.7:
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.5:
            del data[rng.randrange(len(data) + 1) :]
        for decode in decoders:
            try:
                decode(bytes(data))
            except P.ProtocolError:
                pass


@pytest.mark.parametrize(
    "frame, resendable",
    [
        (P.encode_get(1, b"k", False), True),
        (P.encode_watch(1, b"d/", 0, 5), True),
        (P.encode_ping(1), True),
        (P.encode_multi_set_if(1, [(b"lock", b"me")], [b"k"], [b"v"]), True),
        (P.encode_set(1, b"k", b"v", quiet=True), False),
        (P.encode_set(1, b"k", b"v", ephemeral=True), False),
        (P.encode_multi_set(1, [b"k"], [b"v"]), False),
        (P.encode_add(1, b"n", 1), False),
        (P.encode_append(1, b"k", b"v"), False),
        (P.encode_compare_set(1, b"k", b"", b"v"), False),
        (P.encode_delete(1, b"k"), False),
        (P.encode_close_session(1), False),
    ],
    ids=lambda v: P.OP_NAMES[v[4]] if isinstance(v, bytes) else str(v),
)
def test_what_may_be_resent_after_the_session_expired(frame: bytes, resendable: bool) -> None:
    """The resend rule as a table: reads and conditional writes only (docs/protocol.md)."""
    assert P.resendable_after_expiry(frame) is resendable


def test_wait_ms_rounds_up_and_clamps() -> None:
    assert P.wait_ms(0) == 0
    assert P.wait_ms(-1) == 0
    assert P.wait_ms(0.0001) == 1
    assert P.wait_ms(1.5) == 1500
    assert P.wait_ms(1e12) == P.MAX_WAIT_MS


def test_the_protocol_keeps_its_first_import_path() -> None:
    """Code written against ``rdzv.server.protocol`` still imports it (it lives in ``rdzv.kv``)."""
    import rdzv.server.protocol as first_name
    from rdzv.server import protocol as by_package

    assert first_name.encode_ping is P.encode_ping and by_package is first_name
    assert first_name.PROTOCOL_VERSION == P.PROTOCOL_VERSION
