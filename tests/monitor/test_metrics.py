"""``/metrics`` and the JSON of the web view, served by a real store server's monitor: the values
parsed with Prometheus' own text parser and checked against what the test did to the store."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest
from _waiting import eventually

prometheus_parser = pytest.importorskip("prometheus_client.parser")

from rdzv.monitor import monitor_store_server  # noqa: E402
from rdzv.rendezvous import EventWriter  # noqa: E402
from rdzv.rendezvous._history import encode_event, event_key, new_event  # noqa: E402
from rdzv.rendezvous._layout import RunKeys  # noqa: E402
from rdzv.server import StoreServer  # noqa: E402
from rdzv.store import TCPStore  # noqa: E402

SECRET = b"s3cret-for-tests"


def shown(url: str) -> int:
    """How many events of run ``job`` the monitor at ``url`` shows (0: no such run yet)."""
    status, body, _ = get(url + "api/run/job?since=0")
    return len(json.loads(body)["events"]) if status == 200 else 0


def record(server: StoreServer, url: str, events: list[tuple[str, dict[str, Any]]]) -> None:
    """Write ``events`` (kind, fields) to run ``job``'s history in ``server``, as agents do, and
    wait until the monitor at ``url`` shows them (after its settle time)."""
    before = shown(url)
    store = TCPStore("127.0.0.1", server.port)
    writer = EventWriter(store, "job", tag="test")
    try:
        for kind, fields in events:
            writer.record(kind, **fields)
        assert writer.flush(30.0)
    finally:
        writer.close()
        store.close()
    eventually(lambda: shown(url) >= before + len(events), 30, f"the monitor to show {events}")


def get(url: str, password: bytes | None = None, method: str = "GET") -> tuple[int, bytes, Any]:
    request = urllib.request.Request(url, method=method)
    if password is not None:
        token = base64.b64encode(b"anyone:" + password).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def samples(url: str, password: bytes | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of ``url``'s /metrics: (name, sorted labels) -> value."""
    status, body, _ = get(url + "metrics", password)
    assert status == 200, body
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


@pytest.fixture
def served(tmp_path: Any) -> Iterator[tuple[StoreServer, str]]:
    """A durable store server with its monitor on a free port: (server, the monitor's URL)."""
    server = StoreServer("127.0.0.1", 0, data_dir=tmp_path / "data").start()
    monitor = monitor_store_server(server, ("127.0.0.1", 0), None)
    try:
        yield server, monitor.url
    finally:
        monitor.stop()
        server.stop()


def test_requests_by_operation_latency_and_the_log(served: tuple[StoreServer, str]) -> None:
    server, url = served
    before = samples(url)
    store = TCPStore("127.0.0.1", server.port)
    try:
        for i in range(25):
            store.set(f"app/k{i}", b"v")
        for i in range(7):
            assert store.get(f"app/k{i}") == b"v"
        assert store.add("app/n", 3) == 3
        after = samples(url)
        assert after[("rdzv_store_connections", ())] >= 1
    finally:
        store.close()

    def grew(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert grew("rdzv_store_requests_total", (("op", "set"),)) == 25
    assert grew("rdzv_store_requests_total", (("op", "get"),)) == 7
    assert grew("rdzv_store_requests_total", (("op", "add"),)) == 1
    # the get and the add waited for their answers: they were timed (quiet sets are not)
    assert grew("rdzv_store_request_duration_seconds_count") >= 8
    assert after[("rdzv_store_request_duration_seconds_bucket", (("le", "+Inf"),))] == \
        after[("rdzv_store_request_duration_seconds_count", ())]
    # 26 writes reached the write-ahead log, each flush fsynced
    assert grew("rdzv_store_wal_written_bytes_total") > 25 * len("app/k0")
    assert grew("rdzv_store_wal_fsync_duration_seconds_count") >= 1
    assert after[("rdzv_store_keys", ())] == 26
    assert after[("rdzv_monitor_store_up", ())] == 1


def test_a_runs_history_adds_up_in_its_metrics(served: tuple[StoreServer, str]) -> None:
    server, url = served
    record(server, url, [
        ("round_formed", dict(round=0, world_size=2, cause="initial", formation_s=0.04)),
        ("round_formed", dict(round=1, world_size=3, cause="join", formation_s=0.2)),
        ("worker_failed", dict(round=1, rank=2, exit_code=1, error="ValueError: boom")),
        ("training_paused", dict(round=2, pause_s=3.5, cause="membership_change")),
        ("round_formed", dict(round=2, world_size=2, cause="loss", formation_s=1.5)),
    ])
    first = samples(url)
    record(server, url, [("round_formed", dict(round=3, world_size=3, cause="join",
                                               formation_s=0.1))])
    second = samples(url)
    run = (("run", "job"),)
    assert first[("rdzv_run_rounds_formed_total", (("cause", "initial"), ("run", "job")))] == 1
    assert first[("rdzv_run_rounds_formed_total", (("cause", "join"), ("run", "job")))] == 1
    assert first[("rdzv_run_rounds_formed_total", (("cause", "loss"), ("run", "job")))] == 1
    assert first[("rdzv_run_round_formation_seconds_count", run)] == 3
    assert first[("rdzv_run_round_formation_seconds_sum", run)] == pytest.approx(1.74)
    assert first[("rdzv_run_round_formation_seconds_bucket", (("le", "0.05"), ("run", "job")))] == 1
    assert first[("rdzv_run_worker_failures_total", run)] == 1
    assert first[("rdzv_run_training_pause_seconds_sum",
                  (("cause", "membership_change"), ("run", "job")))] == pytest.approx(3.5)
    # the next scrape adds only what is new
    assert second[("rdzv_run_rounds_formed_total", (("cause", "join"), ("run", "job")))] == 2
    assert second[("rdzv_run_round_formation_seconds_count", run)] == 4
    assert second[("rdzv_run_worker_failures_total", run)] == 1
    # no round formed through the engine: the status says so
    assert second[("rdzv_run_round", run)] == -1


def test_an_event_written_late_is_counted_at_the_next_scrape(
    served: tuple[StoreServer, str]
) -> None:
    """An event stamped before the last scrape's newest one but written after that scrape (its
    writer stalled) still counts once: the totals follow the history by its keys, not a cut-off."""
    server, url = served
    late = new_event("worker_failed", round=1, rank=0, exit_code=1)  # stamped now, written later
    record(server, url, [("round_formed", dict(round=1, world_size=2, cause="join",
                                               formation_s=0.1))])
    run = (("run", "job"),)
    assert samples(url)[("rdzv_run_worker_failures_total", run)] == 0
    store = TCPStore("127.0.0.1", server.port)
    try:
        store.set(event_key(RunKeys("job"), late, "stalled"), encode_event(late))
    finally:
        store.close()
    assert samples(url)[("rdzv_run_worker_failures_total", run)] == 1
    assert samples(url)[("rdzv_run_worker_failures_total", run)] == 1  # once, not at each scrape


def test_the_json_the_page_polls(served: tuple[StoreServer, str]) -> None:
    server, url = served
    record(server, url, [("round_formed", dict(round=0, world_size=1, cause="initial",
                                          formation_s=0.01))])
    status, body, headers = get(url + "api/runs")
    runs = json.loads(body)
    assert status == 200 and [r["run_id"] for r in runs["runs"]] == ["job"]
    assert runs["server"]["keys"] >= 1 and headers["Cache-Control"] == "no-store"
    status, body, _ = get(url + "api/run/job?since=0")
    run = json.loads(body)
    assert [e["kind"] for e in run["events"]] == ["round_formed"]
    assert run["events"][0]["fields"]["world_size"] == 1
    status, body, _ = get(url + f"api/run/job?since={run['next_seq']}")
    assert status == 200 and json.loads(body)["events"] == []
    assert get(url + "api/run/job?since=x")[0] == 400
    assert get(url + "nothing")[0] == 404


def test_with_a_secret_every_request_needs_it(tmp_path: Any) -> None:
    server = StoreServer("127.0.0.1", 0, secret=SECRET).start()
    monitor = monitor_store_server(server, ("127.0.0.1", 0), SECRET)
    try:
        url = monitor.url
        # (no run 'job' in this store: past the password its page is not found)
        for path, answer in (("", 200), ("static/app.js", 200), ("api/runs", 200),
                             ("api/run/job", 404), ("metrics", 200)):
            status, _, headers = get(url + path)
            assert status == 401, path
            assert headers["WWW-Authenticate"].startswith("Basic ")
            assert get(url + path, b"wrong")[0] == 401
            assert get(url + path, SECRET)[0] == answer, path
        assert samples(url, SECRET)[("rdzv_store_connections", ())] >= 0
        # read-only: nothing changes state
        assert get(url + "api/runs", SECRET, method="POST")[0] == 405
        assert get(url + "api/runs", SECRET, method="DELETE")[0] == 405
    finally:
        monitor.stop()
        server.stop()


def test_the_page_ships_everything_it_needs() -> None:
    server = StoreServer("127.0.0.1", 0).start()
    monitor = monitor_store_server(server, ("127.0.0.1", 0), None)
    try:
        status, page, headers = get(monitor.url)
        assert status == 200 and b"/static/app.js" in page and b"/static/style.css" in page
        assert b"http://" not in page and b"https://" not in page
        assert headers["Content-Security-Policy"].startswith("default-src 'self'")
        for path in ("static/app.js", "static/style.css"):
            status, body, _ = get(monitor.url + path)
            assert status == 200 and b"https://" not in body
    finally:
        monitor.stop()
        server.stop()


def _rdzv(*argv: str, hide_prometheus: bool = False) -> subprocess.CompletedProcess[str]:
    hide = "import sys; sys.modules['prometheus_client'] = None; " if hide_prometheus else ""
    code = f"{hide}import sys; from rdzv.cli import main; sys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env={**os.environ})


def test_without_prometheus_client_the_flag_says_what_to_install() -> None:
    result = _rdzv("serve", "--host", "127.0.0.1", "--port", "0", "--web", "0",
                   hide_prometheus=True)
    assert result.returncode == 1
    assert "pip install 'rdzv[monitor]'" in result.stderr


def test_a_malformed_web_address_is_a_usage_error() -> None:
    result = _rdzv("status", "tcp://127.0.0.1:1/job", "--web", "host:port")
    assert result.returncode == 2
    assert "--web takes [HOST:]PORT" in result.stderr
