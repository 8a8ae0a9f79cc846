"""StoreServer and TCPStore in one process: bad input, handshake, auth, sessions, errors."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest
from _clock import ManualClock
from _raw import Raw, wait_until

from rdzv.errors import (
    SessionExpiredError,
    StoreAuthenticationError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreTimeoutError,
    StoreValueError,
)
from rdzv.server import StoreServer
from rdzv.kv import protocol as P
from rdzv.store import TCPStore
from rdzv.store import _tcp as tcp_store


def still_serving(server: StoreServer, store: TCPStore) -> None:
    """The server answers the existing client and a brand-new one."""
    store.set("alive", "yes")
    with TCPStore("127.0.0.1", server.port, timeout=10) as fresh:
        assert fresh.get("alive") == b"yes"


# -- bad input: answered or dropped, never the server's end --------------------------------------
def test_garbage_before_handshake_drops_only_that_connection(
    server: StoreServer, store: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rdzv.server"):
        raw = Raw(server.port)
        raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.closed_by_server()
        raw.close()
    assert "dropping the connection from 127.0.0.1:" in caplog.text
    still_serving(server, store)


def test_wrong_magic_is_dropped(server: StoreServer, store: TCPStore) -> None:
    raw = Raw(server.port)
    raw.send(P.frame(b"XXXX" + bytes(36)))
    assert raw.closed_by_server()
    still_serving(server, store)


def test_random_frames_after_handshake_are_answered(server: StoreServer, store: TCPStore) -> None:
    import random

    rng = random.Random(7)
    raw = Raw(server.port)
    raw.handshake()
    for rid in range(1, 300):
        body = bytes([rng.randrange(256)]) + struct.pack("<I", rid)
        body += bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        status, got, _ = raw.call(P.frame(body))
        assert got == rid and status in (P.STATUS_OK, P.STATUS_ERROR, P.STATUS_TIMEOUT)
    still_serving(server, store)


def test_garbage_length_after_handshake_drops_the_connection(server: StoreServer, store: TCPStore) -> None:
    raw = Raw(server.port)
    raw.handshake()
    raw.send(b"\xff\xfe\xfd\xfc" + bytes(range(256)) * 4)
    assert raw.closed_by_server()
    still_serving(server, store)


def test_oversized_frame_gets_an_error_then_the_connection_is_dropped(
    store: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    with StoreServer("127.0.0.1", 0, max_frame_size=4096) as small:
        raw = Raw(small.port)
        raw.handshake()
        with caplog.at_level(logging.WARNING, logger="rdzv.server"):
            raw.send(P.LEN.pack(1 << 20) + b"\x02" + bytes(100))
            status, rid, payload = P.decode_response(raw.frame())
            assert (status, rid) == (P.STATUS_ERROR, 0)
            code, message = P.decode_error(payload)
            assert code == P.E_FRAME_TOO_LARGE and "4096" in message
            assert raw.closed_by_server()
        assert "exceeds the maximum frame size" in caplog.text
        with TCPStore("127.0.0.1", small.port, timeout=10) as client:
            client.set("k", b"x" * 1000)
            with pytest.raises(StoreValueError, match="maximum frame size"):
                client.set("k", b"x" * 5000)
            assert client.get("k") == b"x" * 1000


def test_unknown_opcode_is_answered_and_the_connection_kept(server: StoreServer) -> None:
    raw = Raw(server.port)
    raw.handshake()
    status, rid, payload = raw.call(P.REQ_HEAD.pack(P.HEAD_SIZE, 250, 77))
    assert (status, rid) == (P.STATUS_ERROR, 77)
    assert P.decode_error(payload)[0] == P.E_UNKNOWN_OP
    assert raw.call(P.encode_ping(78)) == (P.STATUS_OK, 78, b"")


@pytest.mark.parametrize(
    "body",
    [
        struct.pack("<BI", P.OP_SET, 5) + b"\x00\xff\x00\x00\x00k",  # key longer than the frame
        struct.pack("<BI", P.OP_GET, 5) + b"\x01",  # arguments missing
        struct.pack("<BI", P.OP_NUM_KEYS, 5) + b"extra",  # arguments too many
        struct.pack("<BI", P.OP_MULTI_SET, 5) + struct.pack("<I", 3) + b"\x01\x00\x00\x00k",
        struct.pack("<BI", P.OP_DELETE, 5) + b"\xff\xfe\xfd",  # key not UTF-8
        struct.pack("<BI", P.OP_WAIT, 5) + struct.pack("<II", 0, 2**31),
    ],
)
def test_malformed_arguments_are_answered_and_the_connection_kept(
    server: StoreServer, store: TCPStore, body: bytes
) -> None:
    raw = Raw(server.port)
    raw.handshake()
    status, rid, payload = raw.call(P.frame(body))
    assert (status, rid) == (P.STATUS_ERROR, 5)
    assert P.decode_error(payload)[0] in (P.E_BAD_REQUEST, P.E_VALUE)
    assert raw.call(P.encode_ping(6))[:2] == (P.STATUS_OK, 6)
    still_serving(server, store)


def test_truncated_frame_then_vanishing_client(server: StoreServer, store: TCPStore) -> None:
    raw = Raw(server.port)
    raw.handshake()
    frame = P.encode_set(1, b"half", b"x" * 1000)
    raw.send(frame[: len(frame) // 2])
    raw.close()
    still_serving(server, store)
    assert store.try_get("half") is None


def test_client_vanishing_mid_blocking_get(server: StoreServer, store: TCPStore) -> None:
    raw = Raw(server.port)
    raw.handshake()
    raw.send(P.encode_get(1, b"never", True, 60000))
    core = server._core
    assert core is not None
    wait_until(lambda: core.waiters.get("never"), 10, "the blocking get to wait on the server")
    raw.close()
    store.set("never", "now")  # the waiter of the vanished client must not break the wake-up
    still_serving(server, store)


def test_handshake_not_completed_is_dropped(
    server: StoreServer, store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rdzv.server._conn as S

    monkeypatch.setattr(S, "HANDSHAKE_TIMEOUT", 0.3)
    raw = Raw(server.port)
    assert raw.closed_by_server(within=10)
    still_serving(server, store)


def test_client_not_reading_its_answers_does_not_stall_others(server: StoreServer, store: TCPStore) -> None:
    store.set("big", b"b" * (1 << 20))
    raw = Raw(server.port)
    raw.handshake()
    raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = P.encode_get(1, b"big", False)
    raw.sock.settimeout(0.5)
    try:
        for _ in range(5000):  # 5 GiB of answers if the server produced them all at once
            raw.sock.sendall(request)
    except (socket.timeout, BlockingIOError):
        pass  # the server stopped reading this client
    core = server._core
    assert core is not None
    wait_until(lambda: any(not c.reading for c in list(core.conns)), 10,
               "the server to stop reading the client that does not read its answers")
    buffered = max(c.buffered() for c in list(core.conns))
    assert buffered <= core.out_limit
    started = time.monotonic()
    still_serving(server, store)
    assert time.monotonic() - started < 5
    raw.close()


def test_pipelined_requests_beyond_the_buffer_limit_are_all_answered_in_order() -> None:
    with StoreServer("127.0.0.1", 0, max_frame_size=256 * 1024) as small:
        raw = Raw(small.port)
        raw.handshake()
        raw.call(P.encode_set(1, b"v", b"x" * 200_000))
        count = 100  # 20 MB of answers, 16 times the connection's buffer limit
        sender = threading.Thread(
            target=raw.send, args=(b"".join(P.encode_get(10 + i, b"v", False) for i in range(count)),)
        )
        sender.start()
        for i in range(count):
            status, rid, payload = P.decode_response(raw.frame())
            assert (status, rid, len(payload)) == (P.STATUS_OK, 10 + i, 200_001)
        sender.join()
        assert raw.call(P.encode_ping(999)) == (P.STATUS_OK, 999, b"")


# -- handshake: versions, auth ---------------------------------------------------------------
def test_other_protocol_version_is_refused_with_both_versions_named(
    server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    raw = Raw(server.port)
    with caplog.at_level(logging.WARNING, logger="rdzv.server"):
        raw.send(P.frame(P.MAGIC + struct.pack("<H", 99) + bytes(34)))
        challenge = P.decode_challenge(raw.frame())
        assert raw.closed_by_server()
    assert challenge.status == P.HS_VERSION_MISMATCH
    assert f"version {P.PROTOCOL_VERSION}" in challenge.message and "version 99" in challenge.message
    assert "protocol version mismatch" in caplog.text


def test_client_of_other_version_gets_a_typed_error(
    server: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_hello = P._HELLO

    def hello_v3(ttl: float, resume: int, token: bytes, nonce: bytes, has_secret: bool) -> bytes:
        return P.frame(real_hello.pack(P.MAGIC, 3, 0, ttl, resume, bytes(16), nonce))

    monkeypatch.setattr(P, "encode_hello", hello_v3)
    with pytest.raises(StoreProtocolError, match="version mismatch.*version 3.*same rdzv version"):
        TCPStore("127.0.0.1", server.port, timeout=5)


def test_a_version_1_client_is_told_to_upgrade(server: StoreServer) -> None:
    """A client of protocol 1 (which resumed sessions by id alone) gets the mismatch."""
    raw = Raw(server.port)
    v1_hello = struct.pack("<4sHHdQ16s", P.MAGIC, 1, 0, 30.0, 0, bytes(16))
    raw.send(P.frame(v1_hello))
    challenge = P.decode_challenge(raw.frame())
    assert challenge.status == P.HS_VERSION_MISMATCH
    assert "server speaks version 2, the client version 1" in challenge.message
    assert raw.closed_by_server()


def test_client_talking_to_a_non_rdzv_server() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer() -> None:
        conn, _ = listener.accept()
        conn.recv(1024)
        conn.sendall(b"\x10\x00\x00\x00HTTP/1.1 400 Bad")
        conn.settimeout(10)
        try:
            conn.recv(1)  # until the client hangs up, having read the answer
        except OSError:
            pass
        conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    with pytest.raises(StoreProtocolError, match="not an rdzv store server"):
        TCPStore("127.0.0.1", listener.getsockname()[1], timeout=5)
    thread.join()
    listener.close()


def test_auth_right_secret() -> None:
    with StoreServer("127.0.0.1", 0, secret="s3cret") as srv:
        with TCPStore("127.0.0.1", srv.port, timeout=5, secret="s3cret") as client:
            client.set("k", "v")
            assert client.get("k") == b"v"
        with TCPStore("127.0.0.1", srv.port, timeout=5, secret=b"s3cret") as client:
            assert client.get("k") == b"v"


def test_auth_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDZV_STORE_SECRET", "from-env")
    with StoreServer("127.0.0.1", 0, secret="from-env") as srv:
        with TCPStore("127.0.0.1", srv.port, timeout=5) as client:
            client.set("k", "v")


def test_auth_missing_secret(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RDZV_STORE_SECRET", raising=False)
    with StoreServer("127.0.0.1", 0, secret="s3cret") as srv:
        with caplog.at_level(logging.WARNING, logger="rdzv.server"):
            with pytest.raises(StoreAuthenticationError, match="sent none.*RDZV_STORE_SECRET"):
                TCPStore("127.0.0.1", srv.port, timeout=5)
        assert "authentication failed" in caplog.text


def test_auth_wrong_secret() -> None:
    with StoreServer("127.0.0.1", 0, secret="s3cret") as srv:
        with pytest.raises(StoreAuthenticationError, match="does not match") as info:
            TCPStore("127.0.0.1", srv.port, timeout=5, secret="guess")
        assert "s3cret" not in str(info.value) and "guess" not in str(info.value)
        assert isinstance(info.value, StoreConnectionError)


def test_client_with_secret_refuses_a_server_without_auth(server: StoreServer) -> None:
    with pytest.raises(StoreAuthenticationError, match="requires none"):
        TCPStore("127.0.0.1", server.port, timeout=5, secret="s3cret")


def test_auth_failure_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    with StoreServer("127.0.0.1", 0, secret="s3cret") as srv:
        started = time.monotonic()
        with pytest.raises(StoreAuthenticationError):
            TCPStore("127.0.0.1", srv.port, timeout=30, secret="wrong")
        assert time.monotonic() - started < 5


def test_the_secret_never_crosses_the_wire() -> None:
    """A proxy records both directions of an authenticated session."""
    secret = b"very-secret-value-123"
    seen = bytearray()
    with StoreServer("127.0.0.1", 0, secret=secret) as srv:
        proxy = socket.socket()
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    seen.extend(data)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                dst.close()

        def accept() -> None:
            conn, _ = proxy.accept()
            upstream = socket.create_connection(("127.0.0.1", srv.port))
            threading.Thread(target=pump, args=(conn, upstream), daemon=True).start()
            pump(upstream, conn)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        with TCPStore("127.0.0.1", proxy.getsockname()[1], timeout=5, secret=secret) as client:
            client.set("k", "v")
            assert client.get("k") == b"v"
        thread.join(5)
        proxy.close()
    assert b"k" in seen and secret not in seen


# -- sessions ------------------------------------------------------------------------------------
def test_resent_write_after_reconnect_is_not_applied_twice(server: StoreServer) -> None:
    first = Raw(server.port)
    first.handshake(ttl=30)
    status, _, payload = first.call(P.encode_add(41, b"counter", 5))
    assert (status, payload) == (P.STATUS_OK, b"5")
    second = Raw(server.port)  # the same client, reconnected after losing the answer
    welcome = second.handshake(resume=first.session, token=first.token, ttl=30)
    assert welcome.resumed and welcome.session == first.session
    assert first.closed_by_server()
    assert second.call(P.encode_add(41, b"counter", 5)) == (P.STATUS_OK, 41, b"5")
    assert second.call(P.encode_add(42, b"counter", 5)) == (P.STATUS_OK, 42, b"10")


def test_unknown_session_is_not_resumed(server: StoreServer) -> None:
    raw = Raw(server.port)
    welcome = raw.handshake(resume=987654)
    assert not welcome.resumed and welcome.session != 987654


def test_close_deletes_ephemeral_keys_at_once(server: StoreServer, store: TCPStore) -> None:
    other = TCPStore("127.0.0.1", server.port, timeout=10)
    other.set("eph", "1", ephemeral=True)
    other.compare_set("eph2", "", "1", ephemeral=True)
    other.set("kept", "1")
    other.close()
    assert store.try_get("eph") is None and store.try_get("eph2") is None
    assert store.try_get("kept") == b"1"
    with pytest.raises(StoreError, match="closed"):
        other.get("kept")


def test_dropped_connection_deletes_ephemeral_keys_at_once(server: StoreServer, store: TCPStore) -> None:
    raw = Raw(server.port)
    raw.handshake()
    assert raw.call(P.encode_set(1, b"raw-eph", b"1", True))[0] == P.STATUS_OK
    since = store.revision("raw-eph")
    raw.close()
    assert store.watch("raw-eph", since, 5) > since
    assert store.try_get("raw-eph") is None


def test_silent_connection_expires_after_its_ttl(server: StoreServer, store: TCPStore) -> None:
    raw = Raw(server.port)
    raw.handshake(ttl=0.5)
    raw.call(P.encode_set(1, b"quiet", b"1", True))
    started = time.monotonic()
    wait_until(lambda: store.try_get("quiet") is None, 10, "the silent client's key expired")
    assert time.monotonic() - started >= 0.4
    assert raw.closed_by_server()


def test_idle_client_keeps_its_session_by_keepalive(server: StoreServer, store: TCPStore) -> None:
    idle = TCPStore("127.0.0.1", server.port, timeout=10, session_ttl=0.6)
    idle.set("idle-eph", "1", ephemeral=True)
    time.sleep(2.0)  # more than 3 ttl without a call of its own
    assert store.try_get("idle-eph") == b"1"
    idle.close()


def test_the_keepalive_pings_when_the_clients_clock_says_it_is_idle(server: StoreServer) -> None:
    clock = ManualClock()
    idle = TCPStore("127.0.0.1", server.port, timeout=10, session_ttl=30, clock=clock)
    try:  # a ping after 10 s of its clock without a call; real time moves well under that
        idle.set("idle", "1")

        def pings() -> int:
            return server.metrics().requests.get("ping", 0)

        assert pings() == 0
        clock.advance(10.5)
        wait_until(lambda: pings() == 1, 5, "a ping once the client's clock says it is idle")
        clock.advance(10.5)
        wait_until(lambda: pings() == 2, 5, "the next period's ping")
    finally:
        idle.close()


def test_blocking_get_longer_than_the_ttl_keeps_the_session(server: StoreServer, store: TCPStore) -> None:
    waiter = TCPStore("127.0.0.1", server.port, timeout=10, session_ttl=0.6)
    waiter.set("waiter-eph", "1", ephemeral=True)
    threading.Timer(2.0, lambda: store.set("late", "x")).start()
    assert waiter.get("late") == b"x"
    assert store.try_get("waiter-eph") == b"1"
    waiter.close()


def test_session_expired_while_disconnected_is_reported(server: StoreServer, store: TCPStore) -> None:
    client = TCPStore("127.0.0.1", server.port, timeout=10, session_ttl=30)
    client.set("mine", "1", ephemeral=True)
    old_session = client.session_id
    client._conn._sock.shutdown(socket.SHUT_RDWR)  # the connection breaks; the server ends the session
    wait_until(lambda: store.try_get("mine") is None, 5, "the session ended")
    with pytest.raises(SessionExpiredError, match=f"session {old_session}"):
        client.set("after", "1")
    client.set("after", "2")  # then it carries on in a new session
    assert store.get("after") == b"2" and client.session_id != old_session
    client.close()


# -- client errors ----------------------------------------------------------------------------------
def test_connection_refused_names_the_address() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    started = time.monotonic()
    with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{port}: connection refused"):
        TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - started < 5


def test_lost_server_is_a_connection_error_naming_the_address() -> None:
    srv = StoreServer("127.0.0.1", 0).start()
    client = TCPStore("127.0.0.1", srv.port, timeout=1)
    client.set("k", "v")
    srv.stop()
    with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{srv.port}"):
        client.get("k")
    client.close()


def test_client_waits_for_a_server_that_starts_late() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    servers: list[StoreServer] = []
    timer = threading.Timer(0.5, lambda: servers.append(StoreServer("127.0.0.1", port).start()))
    timer.start()
    try:
        with TCPStore("127.0.0.1", port, timeout=10) as client:
            client.set("k", "v")
    finally:
        timer.join()
        for srv in servers:
            srv.stop()


def test_timeout_names_the_key(store: TCPStore) -> None:
    store.set_timeout(0.2)
    with pytest.raises(StoreTimeoutError, match="wait timeout after 200ms, keys: missing/key") as info:
        store.get("missing/key")
    assert info.value.keys == ("missing/key",)
    store.set("present", "1")
    with pytest.raises(StoreTimeoutError) as info:
        store.multi_get(["present", "absent"])
    assert info.value.keys == ("absent",)


def test_add_to_non_integer_is_a_value_error(store: TCPStore) -> None:
    store.set("text", "abc")
    with pytest.raises(StoreValueError, match="'text'"):
        store.add("text", 1)
    with pytest.raises(StoreValueError, match="64-bit"):
        store.add("n", 2**70)


def test_calls_from_many_threads_share_one_client(store: TCPStore) -> None:
    def work(n: int) -> None:
        for i in range(200):
            store.add("shared-counter", 1)
            store.set(f"t{n}", str(i))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.get("shared-counter") == b"1600"


# -- torch's constructor ------------------------------------------------------------------------
def test_master_starts_an_embedded_server_on_a_free_port() -> None:
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    assert master.port > 0 and master.server is not None
    worker = TCPStore("127.0.0.1", master.port, timeout=10)
    worker.set("k", "v")
    assert master.get("k") == b"v"
    worker.close()
    master.close()
    with pytest.raises(StoreConnectionError):
        TCPStore("127.0.0.1", master.port, timeout=0.3)


def test_world_size_waits_for_every_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    joined: list[TCPStore] = []
    master_box: list[TCPStore] = []
    servers: list[StoreServer] = []  # the master's embedded server, to see it wait
    real_start_server = tcp_store.start_server

    def start_server(*args: object) -> StoreServer:
        servers.append(real_start_server(*args))
        return servers[-1]

    monkeypatch.setattr(tcp_store, "start_server", start_server)

    def master_waits(watches: int) -> bool:
        """The master blocks in its ``watches``-th watch of the count of clients."""
        core = servers[0]._core if servers else None
        return (core is not None and bool(core.waiters.get(tcp_store.INIT_KEY))
                and servers[0].metrics().requests.get(P.OP_NAMES[P.OP_WATCH], 0) == watches)

    def make_master() -> None:
        master_box.append(TCPStore("127.0.0.1", port, world_size=3, is_master=True, timeout=20))

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    thread = threading.Thread(target=make_master)
    thread.start()
    wait_until(lambda: master_waits(1), 20, "the master to wait for two more clients")
    assert thread.is_alive()  # waiting for two more clients
    joined.append(TCPStore("127.0.0.1", port, world_size=3, timeout=20))
    wait_until(lambda: master_waits(2), 20, "the master to wait for one more client")
    assert thread.is_alive()
    joined.append(TCPStore("127.0.0.1", port, world_size=3, timeout=20))
    thread.join(10)
    assert not thread.is_alive() and master_box
    for client in joined:
        client.close()
    master_box[0].close()


def test_world_size_timeout_says_how_many_joined() -> None:
    with pytest.raises(StoreTimeoutError, match="Timed out after 0.5 seconds waiting for clients. 1/2 clients joined."):
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=0.5)


def test_torch_positional_arguments() -> None:
    from datetime import timedelta

    master = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), True)
    assert master.timeout == timedelta(seconds=10)
    master.close()


@pytest.mark.parametrize(
    "host, port, error, message",
    [("127.0.0.1", 70000, ValueError, "store server port must be an integer between 0 and 65535"),
     ("127.0.0.1", -1, ValueError, "got -1"),
     ("127.0.0.1", "29400", TypeError, "port must be an int, not str"),
     ("~", 0, ValueError, "store server host '~' must be a dot-separated list")],
)
def test_malformed_host_or_port_is_refused_before_listening(host, port, error, message) -> None:
    with pytest.raises(error, match=message):
        StoreServer(host, port)
