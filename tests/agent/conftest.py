"""Fixtures for the agent tests: real ``python -m rdzv.run`` agents on loopback, stopped at the end."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from _agents import JOIN, WORKER, pid_alive, wait_for, worker_records
from _launcher import RDZV_RUN, Launcher, LoggedProcess, free_port


@pytest.fixture
def agents(tmp_path: Any) -> Any:
    """Start agents with ``agents.start(args)``; every agent still running is killed at the end."""

    class Agents(Launcher):
        def start(self, args: list[str], env: dict[str, str] | None = None) -> LoggedProcess:
            return super().start([*RDZV_RUN, *args], env)

    group = Agents(tmp_path, "agent")
    yield group
    group.kill_all()
    group.print_outputs()
    survivors = []
    for record in worker_records(str(tmp_path / "out")) if (tmp_path / "out").exists() else []:
        pid = record["pid"]
        try:
            wait_for(lambda pid=pid: not pid_alive(pid), 60.0, f"worker {pid} to end")
        except AssertionError:
            os.kill(pid, signal.SIGKILL)
            survivors.append(pid)
    assert not survivors, f"worker(s) {survivors} outlived their agent"


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
            """The flags of an agent; its workers (``_worker.py``) do not use the in-process API,
            which the agent takes 1 s after their start (not the 30 s Python and torch may need)."""
            settings = "last_call_timeout=1,heartbeat_interval=1,heartbeat_misses=10"
            return [
                "--nnodes", nnodes, "--nproc-per-node", str(nproc),
                "--rdzv-backend", self.backend, "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", "job", "--rdzv-conf", settings,
                "--local-addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs"),
                "--stop-timeout", "5", "--worker-connect-timeout", "1", *extra,
            ]

        def start(self, agents: Any, count: int, args: list[str]) -> list[Any]:
            """Start ``count`` agents; the first is up (hosting a tcp store) before the others."""
            first = agents.start(args)
            wait_for(lambda: "waiting for nodes" in first.output(), JOIN, "the first agent")
            return [first] + [agents.start(args) for _ in range(count - 1)]

        def worker(self, *extra: str) -> list[str]:
            return [WORKER, str(self.out), *extra]

        def until_stopped(self, nnodes: str, nproc: int) -> list[str]:
            """The flags and workers of a job whose workers run until :meth:`stop` is called."""
            return self.args(nnodes, nproc) + self.worker("--until", self.stop_file)

        def stop(self) -> None:
            """Let the workers of :meth:`until_stopped` finish."""
            open(self.stop_file, "w").close()

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
