"""Helpers of the torch tests: real processes (agents, workers) on loopback, killed at teardown.

A uniquely named module (not ``conftest``): ``from conftest import`` would find another test
directory's conftest when several directories run in one session.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
from _waiting import eventually as wait_for  # noqa: F401 (re-exported to the tests)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
POLL = 0.1


class Proc:
    """A child process in its own session; stdout and stderr go to a log file."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True, cwd=str(log_path.parent),
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"process {self.pid} still running after {timeout:g} s; output:\n{self.output()[-6000:]}"
            ) from None

    def kill(self) -> None:
        """SIGKILL the whole process group (the agent and its workers)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(30)
        else:  # its workers may outlive a finished leader
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._log.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """``procs(argv, env=None)`` starts a process; every one is killed at teardown."""
    started: list[Proc] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(argv, tmp_path / f"proc{len(started)}.log", env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()




def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PYTHON = sys.executable
