"""Take docs/web-view.png: the web view of a real run with a few changes, in headless Chromium.

Run: ``.venv/bin/python scripts/web-view-screenshot.py [--out docs/web-view.png]`` (needs the
test extra's Playwright and Debian's Chromium: ``bash scripts/install-chromium``). Everything
runs on 127.0.0.1: ``rdzv serve --web`` and ``rdzv run`` agents training
``examples/elastic_train.py`` (one worker each); two nodes start, two join, one leaves gracefully
(SIGTERM), one is lost (SIGKILL), and the last to join is slow (``RDZV_EXAMPLE_SLOW``): it is
flagged as a straggler. Every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("RDZV_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STEP_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "web-view.png"))
    args = parser.parse_args()
    from playwright.sync_api import expect, sync_playwright

    store_port, web_port = free_port(), free_port()
    work = Path(tempfile.mkdtemp(prefix="rdzv-shot-"))
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], name: str,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(work / f"{name}.log", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=work,
                                env={**os.environ, **(env or {})})
        started.append(proc)
        return proc

    def agent(name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return start([sys.executable, "-m", "rdzv.run", "--nnodes", "2:4", "--nproc-per-node", "1",
                      "--rdzv-backend", "tcp", "--rdzv-endpoint", f"127.0.0.1:{store_port}",
                      "--rdzv-id", "demo-job", "--rdzv-conf",
                      "last_call_timeout=1,heartbeat_interval=1,heartbeat_misses=3",
                      "--local-addr", "127.0.0.1", "--max-restarts", "3",
                      str(ROOT / "examples" / "elastic_train.py"), "--steps", "100000",
                      "--step-sleep", "0.05", "--checkpoint", str(work / "model.ckpt")],
                     name, env)

    def status() -> str:
        return subprocess.run(
            [sys.executable, "-m", "rdzv", "status", f"tcp://127.0.0.1:{store_port}/demo-job",
             "--json"], capture_output=True, text=True, timeout=60).stdout

    def world(size: int) -> Callable[[], bool]:
        return lambda: f'"world_size": {size},' in status() and '"state": "complete"' in status()

    try:
        start([sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1", "--port",
               str(store_port), "--web", str(web_port)], "serve")
        time.sleep(1.0)
        nodes = [agent("a0"), agent("a1")]
        wait(world(2), "a round of 2")
        time.sleep(3)
        nodes.append(agent("a2"))
        wait(world(3), "a round of 3")
        time.sleep(3)
        nodes.append(agent("a3"))
        wait(world(4), "a round of 4")
        time.sleep(3)
        nodes[3].send_signal(signal.SIGTERM)  # a graceful leave
        wait(world(3), "the round after the leave")
        time.sleep(3)
        os.killpg(nodes[2].pid, signal.SIGKILL)  # a lost node
        wait(world(2), "the round after the loss")
        time.sleep(2)
        nodes.append(agent("a4", {"RDZV_EXAMPLE_SLOW": "0.05"}))
        wait(world(3), "the round after a new node")
        wait(lambda: '"straggler": 2.' in status() or '"straggler": 1.' in status(),
             "the slow node flagged")
        time.sleep(2)
        with sync_playwright() as playwright:
            context = playwright.chromium.launch_persistent_context(
                str(work / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1200, "height": 940}, device_scale_factor=1)
            page = context.pages[0] if context.pages else context.new_page()
            page.goto(f"http://127.0.0.1:{web_port}/#run=demo-job")
            expect(page.locator("#members tbody tr[data-rank]")).to_have_count(3, timeout=60000)
            expect(page.locator("#events tbody tr[data-kind]").first).to_be_attached(timeout=60000)
            time.sleep(1.5)
            page.screenshot(path=args.out)
            context.close()
        print(f"saved {args.out} ({os.path.getsize(args.out) // 1024} KiB)")
        return 0
    finally:
        for proc in reversed(started):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
