"""The web view (``rdzv status --web``) in a real headless browser: Debian's Chromium driven by
Playwright, on a real run of agents (tcp and file). The page loads with no request to another
host, shows the members and the chart, and updates by itself when a node joins. And
``rdzv serve --web``'s ``/metrics`` after a real run, against the run's history."""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable
from urllib.parse import urlsplit

import pytest

from _agents import JOIN, rdzv_cli, wait_for
from _launcher import Launcher, free_port

MEMBERS = "#members tbody tr[data-rank]"

pytestmark = pytest.mark.timeout(900)  # real processes and a browser: slow on a loaded machine


def web_view(rdzv: Any, tmp_path: Path) -> tuple[Launcher, str]:
    """``rdzv status --web`` of the run, started; (its launcher, the page's URL)."""
    views = Launcher(tmp_path, "view")
    port = free_port()
    view = views.start([sys.executable, "-m", "rdzv", "status", "--rdzv-backend", rdzv.backend,
                        "--rdzv-endpoint", rdzv.endpoint, "--rdzv-id", "job",
                        "--web", str(port)])
    wait_for(lambda: "is at http://127.0.0.1:" in view.output(), JOIN, "the web view to start")
    return views, f"http://127.0.0.1:{port}/"


def test_the_page_shows_the_run_and_follows_a_join(agents: Any, rdzv: Any, tmp_path: Path,
                                                   page: Any) -> None:
    args = rdzv.until_stopped("1:3", 1)
    nodes = rdzv.start(agents, 2, args)
    rdzv.running(2)
    views, url = web_view(rdzv, tmp_path)
    try:
        page.goto(url + "#run=%E0%A4%A")  # a malformed address: the page shows the run anyway
        expect = page.expect  # (locator waits: the page's CSP forbids evaluating strings)
        expect(page.locator(MEMBERS)).to_have_count(2, timeout=JOIN * 1000)
        assert page.text_content("#run-id") == "job"
        assert page.text_content("#run-state") == "complete"
        rows = page.locator(MEMBERS)
        assert {rows.nth(i).locator("td").nth(3).text_content() for i in range(2)} == \
            {str(n.pid) for n in nodes}
        assert all(rows.nth(i).locator("td").nth(2).text_content() == "127.0.0.1"
                   for i in range(2))
        line = page.wait_for_selector("#chart svg #world-size-line", state="attached",
                                      timeout=JOIN * 1000)
        assert line.get_attribute("d").startswith("M")  # the world size, drawn
        assert page.locator("#runs a[data-run='job']").count() == 1

        nodes.append(agents.start(args))  # a node joins: the page follows by itself
        expect(page.locator(MEMBERS)).to_have_count(3, timeout=JOIN * 1000)
        # (its row may come a refresh before its agent's entry: host and pid "?" until then)
        expect(page.locator("#members")).to_contain_text(str(nodes[2].pid), timeout=JOIN * 1000)
        assert page.text_content(".fact b") != "0"  # the round moved on
        # the round it joined: in the table of events, and marked on the chart
        joined = page.locator("#events tbody tr[data-kind='round_formed']").filter(
            has_text=f"joined: 127.0.0.1:{nodes[2].pid}:")
        expect(joined).to_have_count(1, timeout=JOIN * 1000)
        assert "cause: join" in joined.text_content()
        assert page.locator("#chart-svg line[data-kind='round_formed']").count() >= 2
        rdzv.running(3)
        expect(page.locator("#live")).to_have_text("live")
        rdzv.stop()
        assert [n.wait() for n in nodes] == [0, 0, 0]
        if rdzv.backend == "tcp":  # the store went with the node that hosted it: the page says so
            expect(page.locator("#live")).to_have_text("unavailable", timeout=JOIN * 1000)
            assert "the store cannot be read" in (page.locator("#live").get_attribute("title")
                                                  or "")
    finally:
        views.kill_all()
    foreign = [u for u in page.requested if urlsplit(u).hostname != "127.0.0.1"]
    assert page.requested and not foreign, f"requests to other hosts: {foreign}"


def test_metrics_of_a_real_run_match_its_history(agents: Any, tmp_path: Path) -> None:
    """``rdzv serve --web``: after rounds formed by real agents (a start, a join, a loss), the
    per-run metrics add up what the run's history says, parsed with Prometheus' parser."""
    parser = pytest.importorskip("prometheus_client.parser")
    store_port, web_port = free_port(), free_port()
    servers = Launcher(tmp_path, "serve")
    server = servers.start([sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                            "--port", str(store_port), "--web", str(web_port)])
    url = f"http://127.0.0.1:{web_port}/"

    def scrape() -> dict[tuple[str, tuple], float]:
        with urllib.request.urlopen(url + "metrics", timeout=30) as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in parser.text_string_to_metric_families(text)
                for s in family.samples}

    def world(size: int) -> Callable[[], bool]:
        def formed() -> bool:
            try:
                with urllib.request.urlopen(url + "api/run/job", timeout=30) as response:
                    status = json.load(response)["status"]
            except urllib.error.HTTPError as exc:  # 404 until the run has keys in the server
                assert exc.code == 404, exc
                return False
            return status["world_size"] == size and status["state"] == "complete"
        return formed

    def history() -> list[dict[str, Any]]:
        result = rdzv_cli("status", f"tcp://127.0.0.1:{store_port}/job", "--events", "--json")
        assert result.returncode == 0, result.stderr
        return [json.loads(line) for line in result.stdout.splitlines()]

    try:
        wait_for(lambda: "web view and /metrics at" in server.output(), JOIN, "rdzv serve --web")
        args = ["--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "tcp",
                "--rdzv-endpoint", f"127.0.0.1:{store_port}", "--rdzv-id", "job",
                "--rdzv-conf", "last_call_timeout=1,heartbeat_interval=1,heartbeat_misses=3",
                "--local-addr", "127.0.0.1", "--no-python", "sleep", "300"]
        nodes = [agents.start(args), agents.start(args)]
        wait_for(world(2), JOIN, "a round of 2")
        nodes.append(agents.start(args))
        wait_for(world(3), JOIN, "a round of 3 after the join")
        os.killpg(nodes[2].pid, signal.SIGKILL)
        wait_for(world(2), JOIN, "a round of 2 after the loss")

        def counted() -> tuple[list[dict[str, Any]], dict[tuple[str, tuple], float]] | None:
            # the rounds of the history, every one counted in /metrics (after its settle time)
            events, metrics = history(), scrape()
            rounds = sum(1 for e in events if e["kind"] == "round_formed")
            done = metrics.get(("rdzv_run_round_formation_seconds_count", (("run", "job"),)))
            return (events, metrics) if done == rounds else None

        events, metrics = wait_for(counted, JOIN, "/metrics to count the history's rounds")
    finally:
        servers.kill_all()
    rounds = [e for e in events if e["kind"] == "round_formed"]
    causes = Counter(e["fields"]["cause"] for e in rounds)
    assert causes["join"] >= 1 and causes["loss"] == 1, causes
    run = (("run", "job"),)
    for cause, count in causes.items():
        assert metrics[("rdzv_run_rounds_formed_total", (("cause", cause), ("run", "job")))] \
            == count
    assert metrics[("rdzv_run_round_formation_seconds_count", run)] == len(rounds)
    assert metrics[("rdzv_run_round_formation_seconds_sum", run)] == \
        pytest.approx(sum(e["fields"]["formation_s"] for e in rounds))
    assert metrics[("rdzv_run_round", run)] == rounds[-1]["round"]
    assert metrics[("rdzv_run_world_size_nodes", run)] == 2
    assert metrics[("rdzv_run_waiting_nodes", run)] == 0
    assert metrics[("rdzv_run_worker_failures_total", run)] == 0
    # the store server's own numbers: the agents' requests, their connections
    assert metrics[("rdzv_store_requests_total", (("op", "set"),))] > 0
    assert metrics[("rdzv_store_connections", ())] >= 2


def test_the_view_of_a_run_on_etcd(agents: Any, tmp_path: Path) -> None:
    """``rdzv status --web`` reads any backend: a run on etcd, its members and its events."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "etcd"))
    from etcd_testing import etcd_params, require_etcd

    from rdzv.etcd import LocalEtcd

    binary = require_etcd(etcd_params()[0].values[0])
    with LocalEtcd(binary=binary) as etcd:
        rdzv = SimpleNamespace(backend="etcd", endpoint=etcd.endpoint)
        args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", "job",
                "--rdzv-conf", "last_call_timeout=1", "--local-addr", "127.0.0.1",
                "--no-python", "sleep", "300"]
        nodes = [agents.start(args), agents.start(args)]
        views, url = web_view(rdzv, tmp_path)
        try:
            def complete() -> dict[str, Any] | None:
                with urllib.request.urlopen(url + "api/run/job", timeout=30) as response:
                    run = json.load(response)
                formed = any(e["kind"] == "round_formed" for e in run["events"])
                return run if run["status"]["world_size"] == 2 and formed else None

            run = wait_for(complete, JOIN, "the round of 2 and its event in the view")
            assert {m["pid"] for m in run["status"]["members"]} == {n.pid for n in nodes}
            with urllib.request.urlopen(url, timeout=30) as response:
                assert b"/static/app.js" in response.read()
        finally:
            views.kill_all()
            agents.kill_all()
