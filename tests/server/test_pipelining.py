"""Pipelined writes: ``set``/``multi_set`` return once sent; ``flush()`` (or any answered call)
confirms them; failures surface on the next call; resent writes are applied once."""

from __future__ import annotations

import os

import pytest
from _raw import Raw, start_server_process

from rdzv.errors import SessionExpiredError, StoreUnsupportedError, StoreValueError
from rdzv.server import StoreServer
from rdzv.server._dispatch import unknown_op
from rdzv.kv import protocol as P
from rdzv.store import TCPStore
from rdzv.store._tcp import MAX_UNACKED_WRITES


def client(port: int) -> TCPStore:
    return TCPStore("127.0.0.1", port, timeout=30)


def test_flushed_sets_are_seen_by_another_client(server: StoreServer) -> None:
    with client(server.port) as writer, client(server.port) as reader:
        for i in range(50):
            writer.set(f"k/{i}", f"v{i}")
        writer.multi_set(["m/a", "m/b"], ["1", "2"])
        writer.flush()
        assert reader.multi_get([f"k/{i}" for i in range(50)]) == [f"v{i}".encode() for i in range(50)]
        assert reader.list_keys("m/") == {"m/a": b"1", "m/b": b"2"}
        writer.flush()  # nothing outstanding: returns at once


def test_a_read_on_the_same_client_sees_its_own_pipelined_sets(server: StoreServer) -> None:
    with client(server.port) as store:
        for i in range(3 * MAX_UNACKED_WRITES):  # more than may stay unacknowledged
            store.set("counter", str(i))
        assert store.get("counter") == str(3 * MAX_UNACKED_WRITES - 1).encode()
        assert store.add("counter", 1) == 3 * MAX_UNACKED_WRITES


def test_close_drains_the_pipelined_sets(server: StoreServer) -> None:
    writer = client(server.port)
    for i in range(20):
        writer.set(f"c/{i}", "x")
    writer.close()
    with client(server.port) as reader:
        assert reader.count_keys("c/") == 20


def test_failed_pipelined_set_is_raised_by_the_next_call_naming_it(server: StoreServer) -> None:
    # A fault injected into the server's state: writing one key fails there.
    state = server._core.state  # type: ignore[union-attr]
    real_set = state.set

    def failing_set(key: str, value: bytes, session: int = 0) -> list[str]:
        if key == "doomed":
            raise StoreValueError("the disk for 'doomed' is full")
        return real_set(key, value, session)

    state.set = failing_set
    with client(server.port) as store:
        store.set("before", "1")
        store.set("doomed", "2")  # returns: the failure is not known yet
        store.set("after", "3")
        with pytest.raises(StoreValueError) as info:
            store.get("after")
        message = str(info.value)
        assert "set('doomed')" in message and "the disk for 'doomed' is full" in message
        # Reported once; the writes around it were applied and the client carries on.
        assert store.multi_get(["before", "after"]) == [b"1", b"3"]
        assert store.try_get("doomed") is None
        store.set("doomed-too", "4")
        store.set("doomed", "5")
        with pytest.raises(StoreValueError, match=r"set\('doomed'\)"):
            store.flush()
        store.flush()
        assert store.get("doomed-too") == b"4"


def test_resent_writes_up_to_the_last_applied_id_are_not_applied_again(server: StoreServer) -> None:
    raw = Raw(server.port)
    raw.handshake(ttl=30.0)
    raw.send(P.encode_set(5, b"k", b"first") + P.encode_set(6, b"k2", b"x"))
    assert [P.decode_response(raw.frame())[:2] for _ in range(2)] == [(P.STATUS_OK, 5), (P.STATUS_OK, 6)]
    with client(server.port) as other:
        other.set("k", "newer")
        other.flush()
        revision = other.revision("k")
        # A new connection resumes the session (as after a lost connection) and resends both.
        again = Raw(server.port)
        assert again.handshake(resume=raw.session, token=raw.token, ttl=30.0).resumed
        raw.close()
        again.send(P.encode_set(5, b"k", b"first") + P.encode_set(6, b"k2", b"x"))
        assert [P.decode_response(again.frame())[:2] for _ in range(2)] == [
            (P.STATUS_OK, 5),
            (P.STATUS_OK, 6),
        ]
        assert other.get("k") == b"newer" and other.revision("k") == revision
        # A returning write resent below the last id is refused, not applied.
        status, rid, payload = again.call(P.encode_add(4, b"n", 1))
        assert (status, rid) == (P.STATUS_ERROR, 4)
        assert "applied already" in P.decode_error(payload)[1]
        assert other.try_get("n") is None
        again.close()


def test_sigkilled_durable_server_with_pipelined_sets_outstanding(tmp_path: object) -> None:
    data_dir = os.path.join(str(tmp_path), "data")
    server, port = start_server_process("--data-dir", data_dir, "--fsync", "never")
    store = reader = None
    try:
        store = TCPStore("127.0.0.1", port, timeout=60, session_ttl=10)
        for i in range(100):
            store.set(f"a/{i}", str(i))
        store.flush()
        flushed_revision = store.revision("a/")
        for i in range(200):
            store.set(f"b/{i}", str(i))  # outstanding when the server dies
        server.kill()
        server.wait()  # dead: its port and its data dir are free (the port is bound with SO_REUSEADDR)
        server, _ = start_server_process("--data-dir", data_dir, "--fsync", "never", port=port)
        store.flush()  # reconnects, resumes its session, resends what was not acknowledged
        reader = TCPStore("127.0.0.1", port, timeout=60)
        assert reader.list_keys("a/") == {f"a/{i}": str(i).encode() for i in range(100)}
        assert reader.list_keys("b/") == {f"b/{i}": str(i).encode() for i in range(200)}
        # The flushed writes were not sent again: nothing under a/ changed after them.
        assert reader.revision("a/") == flushed_revision
    finally:
        for each in (store, reader):
            if each is not None:
                each.close()
        server.kill()
        server.wait()


def test_unacknowledged_writes_of_an_expired_session_are_not_resent_but_named() -> None:
    """The session expired with a write unconfirmed: the expired session may or may not have
    applied it, and applied in the new one it could undo what others did meanwhile (a stale
    rendezvous decision), so it is not sent again; the error names it (docs/protocol.md)."""
    first = StoreServer("127.0.0.1", 0).start()
    port = first.port
    second = None
    store = TCPStore("127.0.0.1", port, timeout=30)
    try:
        store.set("mine", "1", ephemeral=True)
        store.flush()
        first.stop()  # an in-memory server: its data and sessions are gone
        with store.batch():  # sent into the void (or failing to send)
            store.set("after", "2")
            store.multi_set(["m1", "m2"], ["3", "4"])
        second = StoreServer("127.0.0.1", port).start()
        with pytest.raises(SessionExpiredError, match=(
            r"ephemeral keys with it; 2 write\(s\) sent in it were not confirmed and are not "
            r"sent again \(each may or may not have been applied\): set\('after'\), "
            r"multi_set\('m1'\)"
        )):
            store.get("after")
        assert store.try_get("after") is None and store.try_get("m1") is None
        assert store.revision("") == 0  # nothing of the expired session was applied
        store.set("after", "again")  # the new session's writes go on as usual
        assert store.get("after") == b"again"
    finally:
        store.close()
        first.stop()
        if second is not None:
            second.stop()


def test_a_conditional_write_in_flight_when_its_session_expired_is_resent_and_fenced() -> None:
    """A conditional write may be sent again in the new session: its condition on an ephemeral
    key of the expired session (a lock) now fails, so it writes nothing."""
    first = StoreServer("127.0.0.1", 0).start()
    port = first.port
    second = None
    store = TCPStore("127.0.0.1", port, timeout=30)
    try:
        assert store.compare_set("lock", "", "me", ephemeral=True) == b"me"
        first.stop()
        second = StoreServer("127.0.0.1", port).start()
        store._conn._had_ephemeral = False  # as a client that never held an ephemeral key
        assert store.multi_set_if({"lock": "me"}, ["decision"], ["stale"]) is False
        assert store.try_get("decision") is None
    finally:
        store.close()
        first.stop()
        if second is not None:
            second.stop()


LAST_WRITES = {
    "add": (P.encode_add(21, b"n", 5), b"5",
            lambda raw: raw.call(P.encode_add(22, b"n", 5)) == (P.STATUS_OK, 22, b"10")),
    # (checked again, a conditional write's own effect would make it fail)
    "multi_set_if": (P.encode_multi_set_if(21, [(b"status", None)], [b"status"], [b"s"]), P.TRUE,
                     lambda raw: raw.call(P.encode_get(22, b"status", False))
                     == (P.STATUS_OK, 22, P.FOUND + b"s")),
}


@pytest.mark.parametrize("last", sorted(LAST_WRITES))
def test_writes_resent_to_a_restarted_durable_server_are_applied_once(
    tmp_path: object, last: str
) -> None:
    """Pipelined writes logged by a server that is then SIGKILLed, resent by their client on
    its resumed session after the restart: answered as before, not applied again."""
    last_frame, last_answer, applied_once = LAST_WRITES[last]
    data_dir = os.path.join(str(tmp_path), "data")
    server, port = start_server_process("--data-dir", data_dir, "--fsync", "never")
    raw = again = None
    try:
        raw = Raw(port)
        raw.handshake(ttl=30)
        in_flight = b"".join(P.encode_set(rid, b"s/%d" % rid, b"v", quiet=True) for rid in range(1, 21))
        in_flight += last_frame
        raw.send(in_flight)
        assert P.decode_response(raw.frame()) == (P.STATUS_OK, 21, last_answer)  # all logged
        server.kill()  # SIGKILL: the client never learns which of its writes were applied
        server.wait()
        server, _ = start_server_process("--data-dir", data_dir, "--fsync", "never", port=port)
        again = Raw(port)
        assert again.handshake(resume=raw.session, token=raw.token, ttl=30).resumed
        again.send(in_flight)  # the client resends every write it has no answer to
        answers = [P.decode_response(again.frame()) for _ in range(21)]
        assert answers[:20] == [(P.STATUS_OK, rid, b"") for rid in range(1, 21)]
        assert answers[20] == (P.STATUS_OK, 21, last_answer)  # its own answer, not applied again
        assert applied_once(again)
        assert again.call(P.encode_count_keys(23, b"s/")) == (P.STATUS_OK, 23, P.U64.pack(20))
    finally:
        for each in (raw, again):
            if each is not None:
                each.close()
        server.kill()
        server.wait()


def test_writes_held_in_a_batch_reach_a_restarted_server(tmp_path: object) -> None:
    """Writes held in a batch are kept with the pipelined ones: a batch whose server is
    SIGKILLed and restarted before anything was sent still gets every write there."""
    data_dir = os.path.join(str(tmp_path), "data")
    server, port = start_server_process("--data-dir", data_dir, "--fsync", "never")
    try:
        with client(port) as store, client(port) as reader:
            store.set("before", "1")
            store.flush()
            with store.batch():
                store.set("held/a", "1")
                store.multi_set(["held/b", "held/c"], ["2", "3"])
                server.kill()  # nothing of the batch has been sent yet
                server.wait()
                server, _ = start_server_process(
                    "--data-dir", data_dir, "--fsync", "never", port=port
                )
                # The next request finds the connection gone, reconnects and resends them.
                assert store.read_many(["held/a"], ["held/"]).counts == {"held/": 3}
                store.set("held/d", "4")
            assert reader.get("held/d") == b"4"  # sent by the end of the block
            assert reader.multi_get(["before", "held/a", "held/b", "held/c"]) == [
                b"1", b"1", b"2", b"3",
            ]
    finally:
        server.kill()
        server.wait()


def test_a_batch_holds_only_its_own_threads_writes(server: StoreServer) -> None:
    """Another thread's set on the same client is sent at once while a batch is open."""
    import threading

    with client(server.port) as store, client(server.port) as reader:
        in_batch, written = threading.Event(), threading.Event()

        def batch_owner() -> None:
            with store.batch():
                store.set("held/x", "1")
                in_batch.set()
                written.wait(30)

        owner = threading.Thread(target=batch_owner)
        owner.start()
        try:
            assert in_batch.wait(30)
            store.set("other/y", "2")  # this thread is not in the batch
            assert reader.get("other/y") == b"2"
        finally:
            written.set()
            owner.join(30)
        assert reader.get("held/x") == b"1"


def test_unanswered_sets_are_not_resent_into_a_new_session() -> None:
    """A server restarted without its data knows nothing of the client's session: the client's
    unanswered SETs belong to the dead session and are not applied in the new one (an
    ephemeral key would outlive its session, a plain one may undo what others did since); the
    client learns of it through SessionExpiredError, which names them."""
    server, port = start_server_process()
    try:
        with client(port) as store, client(port) as reader:
            store.set("alive", "1", ephemeral=True)
            store.flush()
            server.kill()
            server.wait()
            server, _ = start_server_process(port=port)
            with pytest.raises(SessionExpiredError, match=r"set\('gone/plain'\)"):
                # Written to the dead server's connection (no answer), not sent again.
                store.set("gone/ephemeral", "x", ephemeral=True)
                store.set("gone/plain", "y")
                store.ping()
            assert reader.try_get("gone/plain") is None
            assert reader.try_get("gone/ephemeral") is None
            assert reader.try_get("alive") is None
    finally:
        server.kill()
        server.wait()


def test_a_server_without_conditional_writes_is_a_clear_error_then_a_capability() -> None:
    """A server of an rdzv version before MULTI_SET_IF answers it "unknown opcode" (as any
    unknown op, the connection stays): the client raises StoreUnsupportedError saying so, and
    from then on declares conditional=False (the rendezvous then seals unfenced)."""
    server = StoreServer("127.0.0.1", 0).start()
    core = server._core
    assert core is not None
    core.handlers[P.OP_MULTI_SET_IF] = unknown_op  # as the previous version's table
    store = TCPStore("127.0.0.1", server.port, timeout=30)
    try:
        assert store.capabilities.conditional
        with pytest.raises(StoreUnsupportedError, match="predates conditional writes"):
            store.multi_set_if({"lock": None}, ["k"], ["v"])
        assert not store.capabilities.conditional and TCPStore.capabilities.conditional
        with pytest.raises(StoreUnsupportedError):  # at once, without asking again
            store.multi_set_if({"lock": None}, ["k"], ["v"])
        store.set("after", "1")  # the connection carries on
        assert store.get("after") == b"1" and store.try_get("k") is None
    finally:
        store.close()
        server.stop()
