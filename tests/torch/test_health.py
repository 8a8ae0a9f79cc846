"""Hung workers and slow nodes, with real agents, real torch (gloo) and a standalone store server:

* a worker that hangs in its own code: the others go on within ``--hang-timeout`` + 1 s, its
  stacks are in its node's log and in ``rdzv status --events``, and it rejoins once restarted;
  work outside the steps (``state.outside_steps()``, an evaluation) longer than the timeout is
  no hang;
* a node slowed to about half speed: flagged as a straggler within 30 s (in ``rdzv status``,
  ``/metrics`` and the web page, in a real browser) and, with ``--replace-stragglers`` and a
  spare waiting, replaced in-process; the step rate comes back, and no step is done twice.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _launcher import PYTHON, Launcher, free_port
from _waiting import eventually as wait_for
from test_inprocess import PHASE_TIMEOUT, WORKER, progress
from test_overlaps import agent_args, example, serve

HANG_TIMEOUT = 3.0


def with_hang_timeout(args: list[str], timeout: float) -> list[str]:
    """An agent's ``args`` with ``--hang-timeout timeout`` among its own flags."""
    at = args.index("--max-restarts")
    return [*args[:at], "--hang-timeout", str(timeout), *args[at:]]


def rdzv_status(port: int) -> str:
    return subprocess.run([PYTHON, "-m", "rdzv", "status", f"tcp://127.0.0.1:{port}/job"],
                          capture_output=True, text=True, timeout=60).stdout


def events(port: int, kind: str) -> list[dict[str, Any]]:
    """The run's history events of ``kind``, read by ``rdzv status --events --json``."""
    out = subprocess.run([PYTHON, "-m", "rdzv", "status", f"tcp://127.0.0.1:{port}/job",
                          "--events", "--json"], capture_output=True, text=True, timeout=60)
    found = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return [e for e in found if e.get("kind") == kind]


def rate(entries: list[dict[str, Any]]) -> float:
    """Steps per second over ``entries`` (rank 0's progress lines)."""
    return (entries[-1]["step"] - entries[0]["step"]) / (entries[-1]["time"] - entries[0]["time"])


@pytest.mark.timeout(600)
def test_a_worker_hung_in_its_own_code_is_ended_and_the_others_go_on(
        launcher: Launcher, tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    port = serve(launcher)
    # The job trains on past its 100 steps until the restarted worker has joined (its start,
    # torch's import, has taken 13 s on a loaded machine, and the healthy node alone trains fast)
    args = agent_args(tmp_path, port, example(tmp_path, 100))
    finish = {"RDZV_EXAMPLE_FINISH_WITH": "2:10"}

    # Both workers stop at step 40 and each agent asks its own after its timeout from the
    # worker's last report (every 0.5 s: the two may be 0.5 s apart). The healthy node's shorter
    # timeout makes it ask first, so it is seen to wait (its own hang would be declared only at
    # twice its timeout, 4.8 s) before the hung worker is ended (3 s).
    healthy = launcher.start(with_hang_timeout(args, HANG_TIMEOUT * 0.8), env=finish)
    hung = launcher.start(with_hang_timeout(args, HANG_TIMEOUT),
                          env={**finish, "RDZV_EXAMPLE_HANG_AT": "40"})
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in (healthy, hung)]
    outputs = healthy.output()[-6000:] + hung.output()[-12000:]
    assert codes == [0, 0], outputs
    entries = progress(log)
    steps = [e["step"] for e in entries]
    assert steps == list(range(steps[0], steps[-1] + 1)), steps  # each once: nothing redone
    assert steps[-1] >= 100 and entries[-1]["world_size"] == 2, entries[-1]  # it trained too
    at = steps.index(40)
    gap = entries[at + 1]["time"] - entries[at]["time"]
    assert gap < HANG_TIMEOUT + 1.0, (gap, outputs)
    assert "waits in a collective for another rank" in healthy.output(), outputs
    said = hung.output()
    assert "is hung: no progress for" in said and "its training thread is in its own code" in said
    assert 'elastic_train.py", line' in said and "in train" in said, said  # its stacks
    assert "restarting it alone" in said and "joined a running job" in said, said
    hangs = events(port, "worker_hung")
    assert len(hangs) == 1 and hangs[0]["fields"]["step"] == 40, hangs
    stack = hangs[0]["fields"]["stack"]
    assert any("elastic_train.py" in line and "in train" in line for line in stack), stack
    shown = subprocess.run([PYTHON, "-m", "rdzv", "status", f"tcp://127.0.0.1:{port}/job",
                            "--events"], capture_output=True, text=True, timeout=60).stdout
    assert re.search(r"worker rank \d hung after step 40", shown) and "in train" in shown, shown


@pytest.mark.timeout(600)
def test_work_outside_the_steps_is_no_hang(launcher: Launcher, tmp_path: Path) -> None:
    args = agent_args(tmp_path, serve(launcher), [
        WORKER, "--steps", "60", "--step-sleep", "0.03", "--outside-at", "20",
        "--outside-seconds", str(2 * HANG_TIMEOUT + 1)])
    nodes = [launcher.start(with_hang_timeout(args, HANG_TIMEOUT)) for _ in range(2)]
    codes = [node.wait(PHASE_TIMEOUT) for node in nodes]
    outputs = "".join(node.output()[-4000:] for node in nodes)
    assert codes == [0, 0] and "done: 60 steps" in outputs, outputs
    assert "hung" not in outputs and "made no progress" not in outputs, outputs
    assert all(node.output().count("started 1 worker(s)") == 1 for node in nodes), outputs


@pytest.mark.timeout(600)
def test_a_node_at_half_speed_is_flagged_and_replaced_by_a_spare_in_process(
        launcher: Launcher, tmp_path: Path, page: Any) -> None:
    log = tmp_path / "progress.jsonl"
    port = serve(launcher)
    args = agent_args(tmp_path, port, example(tmp_path, 700))
    args[args.index("--nnodes") + 1] = "1:2"
    args.insert(args.index("--max-restarts"), "--replace-stragglers")
    # signs of life every 3.3 s (a third of a 10 s session ttl): the flag comes ~10 s after
    args[args.index("--rdzv-conf") + 1] += ",heartbeat_interval=1,heartbeat_misses=10"
    # past its 700 steps, the job trains on until the spare, once taken in, has trained 80
    # steps (on a loaded machine its worker's start, torch's import, can outlast the steps left)
    finish = {"RDZV_EXAMPLE_FINISH_WITH": "2:80"}
    healthy = launcher.start(args, env=finish)
    slow = launcher.start(args, env={**finish, "RDZV_EXAMPLE_SLOW": "0.035",
                                     "RDZV_EXAMPLE_SLOW_FROM": "80"})
    web = free_port()
    view = launcher.start([sys.executable, "-m", "rdzv", "status", f"tcp://127.0.0.1:{port}/job",
                           "--web", str(web)])
    found = wait_for(lambda: re.search(r"this node is group rank (\d)", slow.output()),
                     PHASE_TIMEOUT, "the slow node's round")
    rank = found.group(1)
    status = wait_for(lambda: next((line for line in rdzv_status(port).splitlines()
                                    if "straggler (" in line), None), PHASE_TIMEOUT,
                      "the straggler in rdzv status")
    ratio = re.search(r"straggler \((\d+\.\d)x", status)
    assert re.match(rf"\s+{rank}\s+yes\s", status) and ratio and float(ratio[1]) >= 1.5, status
    wait_for(lambda: "is at http://127.0.0.1:" in view.output(), PHASE_TIMEOUT, "the web view")
    with urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    flags = dict(re.findall(r'rdzv_node_straggler\{[^}]*group_rank="(\d)"[^}]*\} (\S+)', metrics))
    assert flags == {rank: "1.0", str(1 - int(rank)): "0.0"}, metrics
    assert re.search(rf'rdzv_node_work_seconds\{{[^}}]*group_rank="{rank}"', metrics), metrics
    page.goto(f"http://127.0.0.1:{web}/")
    marker = page.locator(f"#members tbody tr[data-rank='{rank}'] .badge.straggler")
    page.expect(marker).to_have_count(1, timeout=PHASE_TIMEOUT * 1000)
    shown = re.fullmatch(r"straggler (\d+\.\d)x", marker.text_content() or "")
    assert shown and float(shown[1]) >= 1.5, marker.text_content()  # ~2x the others' work
    assert page.locator("#members .badge.straggler").count() == 1
    # now a spare comes: the straggler is replaced (the spare may be taken in before it says
    # that it waits, the straggler asked to leave as soon as the spare is seen)
    spare = launcher.start(args, env=finish)
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in (healthy, slow, spare)]
    outputs = "".join(node.output()[-5000:] for node in (healthy, slow, spare))
    assert codes == [0, 0, 0], outputs
    entries = progress(log)
    steps = [e["step"] for e in entries]
    assert steps == list(range(steps[0], steps[-1] + 1)), steps  # each once: nothing redone
    assert steps[-1] >= 700, steps
    slowed = entries[steps.index(80)]["time"]
    flagged = events(port, "straggler_flagged")
    # ~10 s (3 slow samples in a row) on a quiet machine; a loaded one breaks streaks
    assert len(flagged) == 1 and 0 < flagged[0]["time"] - slowed < 60, (flagged, slowed)
    assert "asked to leave (a straggler" in slow.output(), outputs
    assert "joined a running job" in spare.output(), outputs
    assert "restarting" not in healthy.output(), outputs  # in-process: one worker all along
    joined = next(i for i, e in enumerate(entries) if e["time"] > flagged[0]["time"] and
                  e["world_size"] == 2 and entries[i - 1]["world_size"] == 1)
    flagged_at = next(i for i, e in enumerate(entries) if e["time"] > flagged[0]["time"])
    before = rate(entries[20:steps.index(80)])
    during = rate(entries[steps.index(80) + 5:flagged_at])
    assert len(entries) - joined >= 60, (joined, len(entries))  # enough steps to measure
    after = rate(entries[joined + 20:])
    # The straggler held every step back (~1.7x slower); with the spare in its place the job is
    # back near its speed before. Ratios of one run, with room for a loaded machine's noise.
    assert after >= 1.3 * during and after >= 0.75 * before, (before, during, after)
    assert not events(port, "straggler_flagged")[1:], "a healthy node was flagged"
