"""What guards the web view's port: the password taken as the store takes its secret
(``$RDZV_STORE_SECRET`` included) or from ``--web-secret-file``, ``--web`` beyond loopback refused
without one, the ``Host`` check against DNS rebinding, only the runs shown answered, idle and
surplus connections closed; and events stamped ahead of the monitor's clock shown once due."""

from __future__ import annotations

import http.client
import json
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("prometheus_client")

from _launcher import Launcher  # noqa: E402
from _waiting import eventually  # noqa: E402
from test_metrics import SECRET, get, record  # noqa: E402

from rdzv.monitor import MonitorServer, RunSource, monitor_store_server  # noqa: E402
from rdzv.rendezvous import RunEvent  # noqa: E402
from rdzv.rendezvous._history import encode_event, event_key  # noqa: E402
from rdzv.rendezvous._layout import RunKeys  # noqa: E402
from rdzv.server import StoreServer  # noqa: E402
from rdzv.store import TCPStore  # noqa: E402

STARTED = 120.0
"""Seconds ``rdzv status --web`` may take to start on a loaded machine."""


def rdzv_status_web(launcher: Launcher, *argv: str, env: dict[str, str] | None = None) -> str:
    """``rdzv status ARGV... --web 0`` started; the page's URL it prints."""
    view = launcher.start([sys.executable, "-m", "rdzv", "status", *argv, "--web", "0"], env=env)

    def url() -> str | None:
        found = re.search(r"is at (http://\S+/)", view.output())
        assert view.process.poll() is None, view.output()
        return found.group(1) if found else None

    return eventually(url, STARTED, "rdzv status --web to print its URL")


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    started = Launcher(tmp_path, "view")
    yield started
    started.kill_all()


def test_the_store_secret_from_the_environment_guards_the_page(launcher: Launcher) -> None:
    server = StoreServer("127.0.0.1", 0, secret=SECRET).start()
    try:
        url = rdzv_status_web(launcher, f"tcp://127.0.0.1:{server.port}/job",
                              env={"RDZV_STORE_SECRET": SECRET.decode()})
        for path in ("", "api/runs", "api/run/job", "metrics"):
            assert get(url + path)[0] == 401, path
            assert get(url + path, SECRET)[0] == 200, path
    finally:
        launcher.kill_all()
        server.stop()


def test_a_web_secret_file_guards_a_store_without_secret(launcher: Launcher,
                                                         tmp_path: Path) -> None:
    (tmp_path / "page-secret").write_bytes(b"page-password\n")
    (tmp_path / "runs").mkdir()
    url = rdzv_status_web(launcher, f"file://{tmp_path / 'runs'}/job",
                          "--web-secret-file", str(tmp_path / "page-secret"))
    assert get(url + "api/run/job")[0] == 401
    assert get(url + "api/run/job", b"page-password")[0] == 200


def test_web_beyond_loopback_without_a_password_is_refused(tmp_path: Path) -> None:
    from test_metrics import _rdzv

    result = _rdzv("status", f"file://{tmp_path}/job", "--web", "0.0.0.0:0")
    assert result.returncode == 2
    assert "--web-secret-file" in result.stderr and "no password" in result.stderr
    result = _rdzv("serve", "--host", "127.0.0.1", "--port", "0", "--web", "0.0.0.0:0")
    assert result.returncode == 1 and "--web-secret-file" in result.stderr
    result = _rdzv("status", f"file://{tmp_path}/job", "--web-secret-file", "x")
    assert result.returncode == 2 and "goes with --web" in result.stderr


def host_status(port: int, host: str | None) -> int:
    """The status of GET /api/runs sent with ``Host: host`` (None: no Host header)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", "/api/runs", skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_on_loopback_without_a_secret_only_local_host_names_are_answered() -> None:
    server = StoreServer("127.0.0.1", 0).start()
    monitor = monitor_store_server(server, ("127.0.0.1", 0), None)
    port = monitor.port
    try:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}",
                     f"LOCALHOST:{port}"):
            assert host_status(port, host) == 200, host
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}",
                     f"127.0.0.1.evil.example:{port}", None):
            assert host_status(port, host) == 421, host
    finally:
        monitor.stop()
        server.stop()
    # with a secret the password is the guard: any Host name
    server = StoreServer("127.0.0.1", 0, secret=SECRET).start()
    monitor = monitor_store_server(server, ("127.0.0.1", 0), SECRET)
    try:
        assert host_status(monitor.port, "evil.example") == 401
    finally:
        monitor.stop()
        server.stop()


def test_only_the_runs_shown_are_answered(tmp_path: Path, launcher: Launcher) -> None:
    server = StoreServer("127.0.0.1", 0).start()
    monitor = monitor_store_server(server, ("127.0.0.1", 0), None)
    try:
        record(server, monitor.url, [("node_waiting", {})])
        assert get(monitor.url + "api/run/job")[0] == 200
        status, body, _ = get(monitor.url + "api/run/no-such-run")
        assert status == 404 and b"no-such-run" in body
    finally:
        monitor.stop()
        server.stop()
    url = rdzv_status_web(launcher, f"file://{tmp_path}/job")
    assert get(url + "api/run/job")[0] == 200
    assert get(url + "api/run/other")[0] == 404


def closed_by_server(conn: socket.socket) -> bool:
    """Whether the server closed ``conn`` (it waits up to the socket's timeout)."""
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_and_surplus_connections_are_closed() -> None:
    server = StoreServer("127.0.0.1", 0).start()
    source = RunSource(lambda: TCPStore("127.0.0.1", server.port), run_id="job")
    monitor = MonitorServer(source, "127.0.0.1", 0, idle_timeout_s=2.0,
                            max_connections=2).start()
    idle = [socket.create_connection(("127.0.0.1", monitor.port), timeout=30) for _ in range(2)]
    try:  # (accepted in turn: the two idle ones hold both slots when the third comes)
        with socket.create_connection(("127.0.0.1", monitor.port), timeout=30) as third:
            assert third.recv(1) == b""  # closed at once: no slot left
        for conn in idle:  # silent: closed after the idle timeout, which frees their slots
            assert closed_by_server(conn)
        eventually(lambda: get(monitor.url + "api/run/job")[0] == 200, 30,
                   "a slot to be free again")
    finally:
        for conn in idle:
            conn.close()
        monitor.stop()
        server.stop()


def test_an_event_stamped_ahead_of_the_monitors_clock_shows_once_due() -> None:
    """A writer whose clock is 2 s ahead: its event is held back by the settle horizon, and
    shown once the horizon passes it, with no further write (a quiet run's last event)."""
    server = StoreServer("127.0.0.1", 0).start()
    monitor = monitor_store_server(server, ("127.0.0.1", 0), None)
    store = TCPStore("127.0.0.1", server.port)
    try:
        record(server, monitor.url, [("node_waiting", {})])
        ahead = time.time() + 2.0
        event = RunEvent(int(ahead * 1e6), ahead, "run_closed", None, "ahead:1", {})
        store.set(event_key(RunKeys("job"), event, "ahead"), encode_event(event))
        seen: list[dict[str, Any]] = []
        next_seq = [0]

        def poll() -> bool:  # as the page does: from next_seq on
            _, body, _ = get(monitor.url + f"api/run/job?since={next_seq[0]}")
            answer = json.loads(body)
            seen.extend(answer["events"])
            next_seq[0] = answer["next_seq"]
            return any(e["kind"] == "run_closed" for e in seen)

        eventually(poll, 30, "the event stamped ahead to show")
        assert [e["kind"] for e in seen] == ["node_waiting", "run_closed"]
    finally:
        store.close()
        monitor.stop()
        server.stop()
