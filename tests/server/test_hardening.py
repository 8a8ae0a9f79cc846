"""The server against confused or hostile clients, as real processes: a resume of another
client's session, and memory taken by stalled uploads and clients that never read."""

from __future__ import annotations

import os
import signal
import socket
import threading

from _raw import Raw, start_server_process, wait_until
from test_processes import Child

import pytest

from rdzv.errors import StoreError
from rdzv.server import StoreServer
from rdzv.kv import protocol as P
from rdzv.store import TCPStore


def test_resuming_another_clients_session_is_refused_and_the_owner_keeps_it() -> None:
    server, port = start_server_process()
    owner = Child("ephemeral", port, 30, "alive/owner")
    try:
        session = int(owner.expect("ready").split()[1])
        observer = TCPStore("127.0.0.1", port, timeout=30)
        for token in (os.urandom(P.TOKEN_SIZE), bytes(P.TOKEN_SIZE)):
            intruder = Raw(port)
            welcome = intruder.handshake(resume=session, token=token, ttl=1.0)
            assert not welcome.resumed and welcome.session != session
            # Whatever the intruder does in its own session leaves the owner's alone.
            assert intruder.call(P.encode_set(1, b"alive/owner-too", b"x", True)) == (
                P.STATUS_OK, 1, b""
            )
            assert intruder.call(P.encode_close_session(2))[0] == P.STATUS_OK
            assert intruder.closed_by_server()
            intruder.close()
        assert observer.try_get("alive/owner") == b"alive"  # the owner's key and session live
        assert observer.try_get("alive/owner-too") is None  # the intruder's went with its own
        assert owner.proc.poll() is None
        since = observer.revision("alive/")
        owner.proc.send_signal(signal.SIGKILL)  # the owner's connection still held the session:
        assert observer.watch("alive/", since, 10) > since  # its end takes the key at once
        assert observer.try_get("alive/owner") is None
        observer.close()
        refused = f"asked to resume session {session} without its token"
        wait_until(lambda: refused in "".join(server.log_lines), 10, "the refusal logged")  # type: ignore[attr-defined]
    finally:
        owner.close()
        if server.poll() is None:
            server.kill()
            server.wait()


def _server_memory(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of process ``pid``."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def test_stalled_uploads_and_clients_that_never_read_stay_within_the_memory_budget() -> None:
    budget = 160 << 20
    server, port = start_server_process("--memory-budget", "160M")
    healthy = TCPStore("127.0.0.1", port, timeout=30)
    big = os.urandom(4 << 20)
    healthy.set("big", big)
    upload = P.encode_set(1, b"upload", bytes(60 << 20))
    uploaders: list[Raw] = []
    readers_never: list[Raw] = []
    threads = []

    def stall(raw: Raw) -> None:  # all of a 60 MiB request but its last byte, then nothing
        try:
            raw.send(upload[:-1])
        except OSError:  # refused: the server closed the connection
            pass

    try:
        for _ in range(4):
            raw = Raw(port, timeout=60)
            raw.handshake()
            uploaders.append(raw)
            thread = threading.Thread(target=stall, args=(raw,), daemon=True)
            thread.start()
            threads.append(thread)
        for _ in range(4):  # 64 gets of a 4 MiB value each, no answer ever read
            raw = Raw(port, timeout=60)
            raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            raw.handshake()
            raw.send(b"".join(P.encode_get(10 + i, b"big", False) for i in range(64)))
            readers_never.append(raw)
        peak_rss = 0
        for i in range(300):  # the healthy client is served, correctly, all along
            healthy.set(f"healthy/{i}", str(i))
            assert healthy.get(f"healthy/{i}") == str(i).encode()
            if i % 50 == 0:
                assert healthy.get("big") == big
            peak_rss = max(peak_rss, _server_memory(server.pid)[0])
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)
        rss, hwm = _server_memory(server.pid)
        assert max(peak_rss, rss, hwm) < budget, (peak_rss, rss, hwm, "".join(server.log_lines))  # type: ignore[attr-defined]
        assert healthy.multi_get([f"healthy/{i}" for i in range(300)]) == [
            str(i).encode() for i in range(300)
        ]
        shed = "is over its memory budget"
        wait_until(lambda: shed in "".join(server.log_lines), 10, "the shedding logged")  # type: ignore[attr-defined]
        log = "".join(server.log_lines)  # type: ignore[attr-defined]
        assert "MiB buffered for" in log and "this connection holds the most" in log, log
    finally:
        for raw in uploaders + readers_never:
            raw.close()
        healthy.close()
        server.kill()
        server.wait()


def test_a_request_beyond_the_memory_budget_gets_a_clear_error_and_the_rest_goes_on() -> None:
    server, port = start_server_process("--memory-budget", "160M")
    stalled = Raw(port, timeout=60)
    try:
        stalled.handshake()
        stalled.send(P.encode_set(1, b"upload", bytes(60 << 20))[:-1])
        client = TCPStore("127.0.0.1", port, timeout=30)
        client.set("alive/me", "1", ephemeral=True)
        session = client.session_id
        with pytest.raises(StoreError, match=r"set\('large'\).*over its memory budget"):
            client.set("large", bytes(61 << 20))  # the largest holder now: refused
            client.flush()
        client.set("small", "fine")  # the server serves on; the client resumed its session
        assert client.get("small") == b"fine" and client.try_get("large") is None
        assert client.session_id == session and client.get("alive/me") == b"1"
        stalled.send(b"\x00")  # the stalled upload was not shed: it completes
        assert P.decode_response(stalled.frame()) == (P.STATUS_OK, 1, b"")
        assert len(client.get("upload")) == 60 << 20
        client.close()
    finally:
        stalled.close()
        server.kill()
        server.wait()


def test_long_pipelines_are_served_in_turns_in_order_and_whole(server: StoreServer) -> None:
    """Thousands of requests in one write are handled a turn at a time, interleaved with the
    other clients', and a client whose answers pile up is held back, then served the rest."""
    a, b = Raw(server.port), Raw(server.port)
    a.handshake()
    b.handshake()
    n = 3000
    a.send(b"".join(P.encode_add(1 + i, b"count/a", 1) for i in range(n)))
    b.send(b"".join(P.encode_add(1 + i, b"count/b", 2) for i in range(n)))
    for raw, step in ((a, 1), (b, 2)):
        for i in range(n):
            assert P.decode_response(raw.frame()) == (P.STATUS_OK, 1 + i, str(step * (i + 1)).encode())
    value = bytes(1 << 20)
    assert a.call(P.encode_set(n + 1, b"mib", value, False)) == (P.STATUS_OK, n + 1, b"")
    gets = 200  # 200 MiB of answers: more than the 65 MiB a client may have pending
    a.send(b"".join(P.encode_get(n + 2 + i, b"mib", False) for i in range(gets)))
    for i in range(gets):
        assert P.decode_response(a.frame()) == (P.STATUS_OK, n + 2 + i, P.FOUND + value)
    assert a.call(P.encode_ping(n + 2 + gets)) == (P.STATUS_OK, n + 2 + gets, b"")
    a.close()
    b.close()
