"""Real programs started by tests (agents, torchrun, workers): each in its own session with its
console output in a log file the test reads, and all of them killed at teardown.

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
from typing import Iterator

import pytest

PYTHON = sys.executable
RDZV_RUN = [PYTHON, "-m", "rdzv.run"]
"""An agent (``rdzv run``) as the tests start it; its flags follow."""
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
"""The repository's example programs."""
EXIT_TIMEOUT = 240.0
"""Seconds a launched program may take to finish on a loaded 2-core machine."""
KILL_TIMEOUT = 30.0
"""Seconds a SIGKILLed process may take to be reaped on a loaded machine."""
CHROMIUM = os.environ.get("RDZV_CHROMIUM", "/usr/bin/chromium")
"""The browser the web view's test drives (Debian's chromium package, scripts/install-chromium)."""
OUTPUT_SHOWN = 8000
"""How many characters of the end of a log a failed wait shows."""


class LoggedProcess:
    """``argv`` in a new session (its own process group), stdout and stderr both to ``log_path``.

    The process runs in the log's directory, so whatever it writes to its working directory stays
    in the test's temporary directory.
    """

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
        """Everything the process printed so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        """The exit code; AssertionError with the end of the output if it runs past ``timeout``."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {self.pid} still running after {timeout:g} s; "
                                 f"output:\n{self.output()[-OUTPUT_SHOWN:]}") from None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the process itself (not its group)."""
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the whole process group, also when its leader has already exited (children
        left in the group, such as torchrun's workers, may outlive it)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.process.poll() is None:
            self.process.wait(KILL_TIMEOUT)
        self._log.close()


class Launcher:
    """Starts processes with numbered logs in one directory, and kills them all at the end."""

    def __init__(self, log_dir: Path, name: str = "proc") -> None:
        self.log_dir = log_dir
        self.name = name
        self.started: list[LoggedProcess] = []
        self.logs: list[Path] = []

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> LoggedProcess:
        log_path = self.log_dir / f"{self.name}{len(self.started)}.log"
        process = LoggedProcess(argv, log_path, env)
        self.started.append(process)
        self.logs.append(log_path)
        return process

    def kill_all(self) -> None:
        """Kill every process started (each once, however often this is called)."""
        while self.started:
            self.started.pop(0).kill()

    def print_outputs(self) -> None:
        """Print the end of every started program's output: called at a test's teardown, pytest
        shows it with a failed test (a wait that timed out says what was missing, these say why)."""
        for log_path in self.logs:
            print(f"--- the end of {log_path.name}:\n"
                  f"{log_path.read_text(errors='replace')[-OUTPUT_SHOWN // 2:]}")


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """``launcher.start(argv, env=None)`` starts a program; every one is killed at teardown."""
    started = Launcher(tmp_path)
    yield started
    started.kill_all()
    started.print_outputs()


def free_port() -> int:
    """A port free on 127.0.0.1 right now (a program started next may take it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
