"""``rdzv status`` on real runs (tcp and file): forming, complete, re-formed, closed; and ``rdzv run
--standalone`` as a user types it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from _agents import JOIN, rdzv_cli, stop, wait_for
from _launcher import EXAMPLES

EXAMPLE = str(EXAMPLES / "print_rank.py")

pytestmark = pytest.mark.timeout(900)  # real processes: slow on a loaded machine


def status(rdzv: Any, *extra: str) -> subprocess.CompletedProcess[str]:
    return rdzv_cli("status", "--rdzv-backend", rdzv.backend, "--rdzv-endpoint", rdzv.endpoint,
                    "--rdzv-id", "job", *extra)


def status_json(rdzv: Any) -> dict[str, Any] | None:
    """The run's status (None: no node has joined it yet, so the store has no such run)."""
    result = status(rdzv, "--json")
    if result.returncode == 1 and "this store has no run 'job'" in result.stderr:
        return None
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_status_follows_a_run_from_forming_to_closed(agents: Any, rdzv: Any) -> None:
    args = rdzv.until_stopped("2:3", 2)
    first = rdzv.start(agents, 1, args)[0]
    forming = wait_for(lambda: (s := status_json(rdzv)) and s["waiting"] == 1 and s, JOIN,
                       "the first node to join round 0")
    assert forming["state"] == "forming" and forming["round"] is None
    assert "no round has formed yet; 1 node(s) joined round 0" in status(rdzv).stdout

    nodes = [first] + [agents.start(args) for _ in range(2)]
    rdzv.running(6)
    complete = wait_for(lambda: (s := status_json(rdzv))["world_size"] == 3 and
                        len(s["members"]) == 3 and s, JOIN, "a round of 3 in the status")
    assert complete["state"] == "complete" and not complete["closed"]
    assert [m["rank"] for m in complete["members"]] == [0, 1, 2]
    assert all(m["alive"] and m["host"] == "127.0.0.1" and m["nproc"] == 2
               for m in complete["members"])
    assert {m["pid"] for m in complete["members"]} == {n.pid for n in nodes}
    # each agent's sign of life is recent (refreshed every few seconds while its workers run)
    assert all(0 <= m["last_seen_s_ago"] < 60 for m in complete["members"])
    assert complete["last_round_s"] is not None
    text = status(rdzv).stdout
    assert "run job: complete" in text and "3 node(s)" in text and "127.0.0.1" in text

    # "up" since the agent's start and since the round must differ: the agents are up 1.5 s
    wait_for(lambda: all(m["started_s_ago"] > 1.5 for m in status_json(rdzv)["members"]), JOIN,
             "the status to show every agent up for more than 1.5 s")
    killed = time.monotonic()
    os.killpg(nodes[2].pid, signal.SIGKILL)
    nodes[2].wait()
    rdzv.running(4)
    reformed = wait_for(lambda: (s := status_json(rdzv))["world_size"] == 2 and s, JOIN,
                        "the re-formed round of 2")
    assert reformed["round"] > complete["round"]
    assert {m["pid"] for m in reformed["members"]} == {nodes[0].pid, nodes[1].pid}
    since_kill = time.monotonic() - killed  # "up" counts from the agent's start, not the round
    assert all(m["started_s_ago"] > since_kill + 1.0 for m in reformed["members"]), reformed

    rdzv.stop()
    assert [nodes[0].wait(), nodes[1].wait()] == [0, 0]
    assert status_json(rdzv)["closed"] if rdzv.backend == "file" else True
    if rdzv.backend == "file":  # the tcp store went away with the node that served it
        assert "run job: closed" in status(rdzv).stdout


def test_status_shows_a_node_that_leaves(agents: Any, rdzv: Any) -> None:
    nodes = rdzv.start(agents, 3, rdzv.until_stopped("2:3", 1))
    rdzv.running(3)
    stuck, leaver = nodes[1], nodes[2]
    stop(stuck, rdzv)  # the others cannot move on: the leaver stays leaving
    try:
        leaver.signal(signal.SIGTERM)
        leaving = wait_for(lambda: (s := status_json(rdzv))["members"] and
                           any(m["leaving"] for m in s["members"]) and s, JOIN,
                           "a leaving member")
        assert [m["pid"] for m in leaving["members"] if m["leaving"]] == [leaver.pid]
        rows = [line.split() for line in status(rdzv).stdout.splitlines()
                if line.split() and line.split()[0].isdigit()]
        assert [row[3] for row in rows if row[1] == "leaving"] == [str(leaver.pid)], rows
        leaver.signal(signal.SIGTERM)  # the second signal stops it at once
        assert leaver.wait() == 128 + signal.SIGTERM
    finally:
        stuck.signal(signal.SIGCONT)
    rdzv.stop()


def test_status_watch_prints_again_on_changes(agents: Any, rdzv: Any) -> None:
    args = rdzv.until_stopped("2", 1)
    rdzv.start(agents, 1, args)
    wait_for(lambda: (s := status_json(rdzv)) and s["waiting"] == 1, JOIN, "the first node")
    watch = subprocess.Popen(
        [sys.executable, "-m", "rdzv", "status", "--rdzv-backend", rdzv.backend,
         "--rdzv-endpoint", rdzv.endpoint, "--rdzv-id", "job", "--watch", "--json",
         "--interval", "30", "--count", "2"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert watch.stdout is not None
        first = json.loads(watch.stdout.readline())
        assert first["state"] == "forming"
        agents.start(args)
        second = json.loads(watch.stdout.readline())  # woken by the change, not the interval
        assert second != first
        assert watch.wait(JOIN) == 0
    finally:
        watch.kill()
        watch.wait(10)
    rdzv.stop()


def test_status_errors_are_clear() -> None:
    result = rdzv_cli("status")
    assert result.returncode == 2 and "which run?" in result.stderr
    result = rdzv_cli("status", "tcp://127.0.0.1:1/job", "--rdzv-conf", "read_timeout=1")
    assert result.returncode == 2 and "not both" in result.stderr
    result = rdzv_cli("status", "tcp://127.0.0.1:1/job?read_timeout=1")
    assert result.returncode == 1 and "127.0.0.1:1" in result.stderr
    result = rdzv_cli("status", "--rdzv-backend", "tcp", "--rdzv-endpoint", "127.0.0.1:1",
                      "--rdzv-id", "job", "--rdzv-conf", "read_timeout=1")
    assert result.returncode == 1 and "cannot open the store of run 'job'" in result.stderr


def test_standalone_prints_each_rank_and_exits_0() -> None:
    result = rdzv_cli("run", "--standalone", "--nproc-per-node", "2", EXAMPLE, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "[0]:hello from rank 0 of 2" in result.stdout
    assert "[1]:hello from rank 1 of 2" in result.stdout
    assert "worker logs:" in result.stderr and "round complete: 1 node(s)" in result.stderr


def test_standalone_failure_summary_names_the_rank() -> None:
    result = rdzv_cli("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                      EXAMPLE, "--fail-rank", "1", timeout=120)
    assert result.returncode == 1
    assert "restart 1 of 1" in result.stderr
    assert "root cause: global rank 1" in result.stderr
    assert "RuntimeError: rank 1 fails on purpose" in result.stderr
