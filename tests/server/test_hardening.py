"""The server against confused or hostile clients, as real processes: a resume of another
client's session, and memory taken by stalled uploads and clients that never read."""

from __future__ import annotations

import os
import signal
import socket

from _raw import Raw, start_server_process, wait_until
from test_processes import Child

from rdzv.server import protocol as P
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
