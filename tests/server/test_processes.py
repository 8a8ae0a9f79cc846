"""The server with real client processes: killed, stopped and many clients; a durable server
SIGKILLed and restarted as a real ``python -m rdzv serve`` process."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from _raw import python_env, start_server_process, wait_until

from rdzv.server import StoreServer
from rdzv.store import TCPStore

HERE = os.path.dirname(os.path.abspath(__file__))


class Child:
    """A ``_client_proc.py`` process whose stdout lines arrive on a queue."""

    def __init__(self, *args: object) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_client_proc.py"), *map(str, args)],
            stdin=subprocess.PIPE,  # (closed when the test ends: the child ends too)
            stdout=subprocess.PIPE,
            text=True,
            env=python_env(),
        )
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("<eof>")

    def expect(self, prefix: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line
            if line == "<eof>":
                raise AssertionError(f"child exited ({self.proc.wait()}) before printing {prefix!r}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        assert self.proc.stdin is not None
        self.proc.stdin.close()


def test_ephemeral_keys_of_a_sigkilled_client_go_at_once(server: StoreServer, store: TCPStore) -> None:
    child = Child("ephemeral", server.port, 30, "alive/killed")
    try:
        child.expect("ready")
        since = store.revision("alive/")
        assert store.get("alive/killed") == b"alive"
        child.proc.kill()
        started = time.monotonic()
        assert store.watch("alive/", since, 10) > since  # woken by the deletion itself
        assert store.try_get("alive/killed") is None
        assert time.monotonic() - started < 2  # at once, not after the 30 s ttl
        assert server.metrics().sessions_expired == 0  # a closed connection: not an expiry
    finally:
        child.close()


def test_ephemeral_keys_of_a_sigstopped_client_go_after_its_ttl(
    server: StoreServer, store: TCPStore
) -> None:
    ttl = 1.5
    child = Child("ephemeral", server.port, ttl, "alive/stopped")
    try:
        child.expect("ready")
        time.sleep(ttl)  # the keepalive holds the session while the child runs
        assert store.try_get("alive/stopped") == b"alive"
        child.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: store.try_get("alive/stopped") is None, ttl + 10, "the key expired")
        waited = time.monotonic() - stopped
        assert ttl * 0.5 <= waited <= ttl + 10
        assert server.metrics().sessions_expired == 1  # (rdzv_store_sessions_expired_total)
    finally:
        child.close()


def test_a_thousand_clients_blocked_in_get_all_woken_by_one_set(
    server: StoreServer, store: TCPStore
) -> None:
    processes, per_process = 4, 250
    total = processes * per_process
    children = [Child("waiters", server.port, per_process, "go") for _ in range(processes)]
    try:
        for child in children:
            child.expect("connected", timeout=120)
        wait_until(lambda: int(store.try_get("ready") or 0) == total, 120, "all clients waiting")
        core = server._core
        assert core is not None
        wait_until(lambda: len(core.waiters.get("go", ())) == total, 30, "all gets on the server")
        started = time.time()
        store.set("go", "now")
        reports = [json.loads(child.expect("{", timeout=120)) for child in children]
        assert sum(r["woken"] for r in reports) == total
        latency = max(r["last"] for r in reports) - started
        print(f"\n{total} waiters woken by one set in {latency * 1000:.1f} ms")
        assert latency < 10
    finally:
        for child in children:
            child.close()


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_sigkilled_durable_server_loses_no_acknowledged_write(tmp_path: object, fsync: str) -> None:
    data_dir = os.path.join(str(tmp_path), "data")
    server, port = start_server_process("--data-dir", data_dir, "--fsync", fsync)
    writer = None
    try:
        observer = TCPStore("127.0.0.1", port, timeout=30, session_ttl=5)
        observer.set("mine", "1", ephemeral=True)
        observer.flush()
        writer = Child("writer", port, 3000)
        acked = int(writer.expect("ack 199").split()[1])
        server.kill()  # SIGKILL, mid-stream
        server.wait()
        dead_at = time.monotonic()  # from here until the restart, nothing is acknowledged
        server, port2 = start_server_process("--data-dir", data_dir, "--fsync", fsync, port=port)
        assert port2 == port
        # Everything the writer saw acknowledged before the kill: its acks stamped before
        # `dead_at`, all of them read once a line stamped after it (or its last) has come.
        last_acked, finished = acked, False
        while True:
            line = writer.expect("")  # the next line, whatever it is
            if not line.startswith("ack "):
                finished = line == "done"
                break
            _, i, stamp = line.split()
            if float(stamp) > dead_at:
                break
            last_acked = max(last_acked, int(i))
        reader = TCPStore("127.0.0.1", port, timeout=30)
        values = reader.multi_get([f"w/{i}" for i in range(last_acked + 1)])
        assert values == [str(i).encode() for i in range(last_acked + 1)]
        # The writer carries on across the restart and finishes; nothing is lost or doubled.
        if not finished:
            writer.expect("done", timeout=120)
        assert writer.proc.wait(30) == 0
        assert reader.multi_get([f"w/{i}" for i in range(3000)]) == [
            str(i).encode() for i in range(3000)
        ]
        # The observer's session was resumed: its ephemeral key survived the restart.
        assert observer.add("carry-on", 1) == 1
        assert reader.try_get("mine") == b"1"
        observer.close()
        assert reader.try_get("mine") is None
        reader.close()
    finally:
        if writer is not None:
            writer.close()
        server.kill()
        server.wait()


def test_recovered_sessions_not_resumed_expire(tmp_path: object) -> None:
    data_dir = os.path.join(str(tmp_path), "data")
    server, port = start_server_process("--data-dir", data_dir)
    try:
        gone = TCPStore("127.0.0.1", port, timeout=30, session_ttl=1.0)
        gone.set("orphan", "1", ephemeral=True)
        gone.flush()
        server.kill()
        server.wait()
        gone._conn._disconnect()  # this client never comes back
        gone._conn._closed = True
        server, _ = start_server_process("--data-dir", data_dir, port=port)
        reader = TCPStore("127.0.0.1", port, timeout=30)
        assert reader.try_get("orphan") == b"1"  # kept for a ttl window after the restart
        wait_until(lambda: reader.try_get("orphan") is None, 15, "the orphan session expired")
        reader.close()
    finally:
        server.kill()
        server.wait()


def test_serve_stops_cleanly_on_sigterm_and_sigint(tmp_path: object) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        server, port = start_server_process("--data-dir", os.path.join(str(tmp_path), sig.name))
        client = TCPStore("127.0.0.1", port, timeout=5)
        client.set("k", "v")
        server.send_signal(sig)
        assert server.wait(30) == 0
        client._conn._closed = True
        client._conn._disconnect()


def test_serve_secret_file_and_bad_options(tmp_path: object) -> None:
    secret_file = os.path.join(str(tmp_path), "secret")
    with open(secret_file, "w") as f:
        f.write("file-secret\n")
    server, port = start_server_process("--secret-file", secret_file)
    try:
        with TCPStore("127.0.0.1", port, timeout=5, secret="file-secret") as client:
            client.set("k", "v")
    finally:
        server.terminate()
        server.wait()
    missing = subprocess.run(
        [sys.executable, "-m", "rdzv", "serve", "--port", "0", "--secret-file", secret_file + ".nope"],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=60,
    )
    assert missing.returncode == 2 and "secret file" in missing.stderr


def test_second_server_on_the_same_data_dir_is_refused(tmp_path: object) -> None:
    data_dir = os.path.join(str(tmp_path), "data")
    server, _ = start_server_process("--data-dir", data_dir)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "rdzv", "serve", "--port", "0", "--data-dir", data_dir],
            capture_output=True,
            text=True,
            env=python_env(),
            timeout=60,
        )
        assert second.returncode == 1 and "in use by another" in second.stderr
    finally:
        server.terminate()
        server.wait()


def test_client_carries_on_in_its_session_across_a_stalled_server() -> None:
    server, port = start_server_process()
    try:
        client = TCPStore("127.0.0.1", port, timeout=60, session_ttl=1.5)  # replies within 5 s
        observer = TCPStore("127.0.0.1", port, timeout=60, session_ttl=30)
        client.set("mine", "1", ephemeral=True)
        session = client.session_id
        server.send_signal(signal.SIGSTOP)
        threading.Timer(7.0, lambda: server.send_signal(signal.SIGCONT)).start()
        assert client.add("counter", 1) == 1  # no reply for 7 s: reconnect, resend, once only
        assert client.session_id == session
        assert observer.try_get("mine") == b"1"
        assert observer.get("counter") == b"1"
        client.close()
        observer.close()
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
