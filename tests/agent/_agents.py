"""Helpers of the agent tests: ``python -m rdzv.run`` processes, bounded polling, worker records."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any
from _waiting import eventually as wait_for  # noqa: F401 (re-exported to the tests)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_worker.py")
EXIT_TIMEOUT = 240.0
"""Seconds an agent may take to finish on a loaded 2-core machine."""
POLL = 0.05
JOIN = 180.0
"""Seconds for a round to form and its workers to start on a loaded machine."""


class Agent:
    """An ``rdzv run`` process; its console output goes to a file the test can read."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rdzv.run", *args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {self.pid} still running after {timeout:g} s; "
                                 f"output:\n{self.output()}") from None

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)
        self._log.close()




def worker_records(out_dir: str) -> list[dict[str, Any]]:
    """Every env record written by test workers (``_worker.py``)."""
    records = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(path) as handle:
            records.append(json.load(handle))
    return records


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by init) counts as dead
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
