"""The web view (``rdzv status --web``) in a real headless browser: Debian's Chromium driven by
Playwright, on a real run of agents (tcp and file). The page loads with no request to another
host, shows the members and the chart, and updates by itself when a node joins."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import pytest

from _agents import JOIN, wait_for
from _launcher import Launcher, free_port

CHROMIUM = os.environ.get("RDZV_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MEMBERS = "#members tbody tr[data-rank]"

pytestmark = pytest.mark.timeout(900)  # real processes and a browser: slow on a loaded machine


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    """A page of a fresh headless Chromium (its own profile); every request it makes is
    recorded in ``page.requested``."""
    sync_api = pytest.importorskip("playwright.sync_api")  # (CI=true: tests/conftest.py fails)
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: bash scripts/install-chromium")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.requested = []
            page.expect = sync_api.expect
            page.on("request", lambda request: page.requested.append(request.url))
            yield page
        finally:
            context.close()


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
        page.goto(url)
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
        assert str(nodes[2].pid) in page.text_content("#members")
        assert page.text_content(".fact b") != "0"  # the round moved on
        # the round it joined: in the table of events, and marked on the chart
        joined = page.locator("#events tbody tr[data-kind='round_formed']").filter(
            has_text=f"joined: 127.0.0.1:{nodes[2].pid}:")
        expect(joined).to_have_count(1, timeout=JOIN * 1000)
        assert "cause: join" in joined.text_content()
        assert page.locator("#chart-svg line[data-kind='round_formed']").count() >= 2
        rdzv.running(3)
    finally:
        views.kill_all()
    foreign = [u for u in page.requested if urlsplit(u).hostname != "127.0.0.1"]
    assert page.requested and not foreign, f"requests to other hosts: {foreign}"
    rdzv.stop()
    assert [n.wait() for n in nodes] == [0, 0, 0]
