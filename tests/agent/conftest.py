"""Fixtures for the agent tests: real ``python -m rdzv.run`` agents on loopback, stopped at the end."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_worker.py")
EXIT_TIMEOUT = 90.0
"""Seconds an agent may take to finish on a loaded 2-core machine."""
POLL = 0.05
JOIN = 60.0
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


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns a true value (bounded in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(POLL)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


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


@pytest.fixture
def agents(tmp_path: Any) -> Any:
    """Start agents with ``agents.start(args)``; every agent still running is killed at the end."""

    class Agents:
        def __init__(self) -> None:
            self.started: list[Agent] = []

        def start(self, args: list[str], env: dict[str, str] | None = None) -> Agent:
            agent = Agent(args, str(tmp_path / f"agent{len(self.started)}.log"), env)
            self.started.append(agent)
            return agent

    group = Agents()
    yield group
    for agent in group.started:
        agent.kill()
    survivors = []
    for record in worker_records(str(tmp_path / "out")) if (tmp_path / "out").exists() else []:
        deadline = time.monotonic() + 10.0
        while pid_alive(record["pid"]) and time.monotonic() < deadline:
            time.sleep(POLL)
        if pid_alive(record["pid"]):
            os.kill(record["pid"], signal.SIGKILL)
            survivors.append(record["pid"])
    assert not survivors, f"worker(s) {survivors} outlived their agent"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=["tcp", "file"])
def rdzv(request: Any, tmp_path: Any) -> Any:
    """Rendezvous flags for one run of a given backend, and the workers' output directory.

    With tcp, the first node started hosts the store server; tests kill or stop only others.
    """

    class Run:
        backend = request.param
        out = tmp_path / "out"
        stop_file = str(tmp_path / "stop")
        endpoint = f"127.0.0.1:{free_port()}" if backend == "tcp" else str(tmp_path / "rdzv")

        def args(self, nnodes: str, nproc: int = 2, *extra: str) -> list[str]:
            settings = "last_call_timeout=1,heartbeat_interval=1,heartbeat_misses=3"
            return [
                "--nnodes", nnodes, "--nproc-per-node", str(nproc),
                "--rdzv-backend", self.backend, "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", "job", "--rdzv-conf", settings,
                "--local-addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs"),
                "--stop-timeout", "5", *extra,
            ]

        def start(self, agents: Any, count: int, args: list[str]) -> list[Any]:
            """Start ``count`` agents; the first is up (hosting a tcp store) before the others."""
            first = agents.start(args)
            wait_for(lambda: "waiting for nodes" in first.output(), JOIN, "the first agent")
            return [first] + [agents.start(args) for _ in range(count - 1)]

        def worker(self, *extra: str) -> list[str]:
            return [WORKER, str(self.out), *extra]

        def running(self, world_size: int) -> list[dict[str, Any]]:
            """The records of a complete group of ``world_size`` workers (waits for them)."""

            def complete() -> list[dict[str, Any]] | None:
                latest: dict[str, dict[str, Any]] = {}
                for record in worker_records(str(self.out)):
                    if record["WORLD_SIZE"] == str(world_size):
                        latest[record["RANK"]] = record
                return list(latest.values()) if len(latest) == world_size else None

            return wait_for(complete, JOIN, f"{world_size} workers of a group of {world_size}")

    run = Run()
    run.out.mkdir()
    return run
