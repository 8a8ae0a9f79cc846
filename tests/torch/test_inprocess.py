"""Membership changes without restarting the workers: real agents, real torch (gloo, CPU).

Under ``rdzv run`` a training loop on ``rdzv.torch.ElasticState`` goes on through a join and a
graceful leave: the workers of the running nodes keep their processes, switch to the new group
at one step, and rank 0's steps stay strictly consecutive.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _launcher import EXAMPLES, PYTHON, RDZV_RUN, Launcher, free_port
from _waiting import eventually as wait_for

EXAMPLE = str(EXAMPLES / "elastic_train.py")
WORKER = str(Path(__file__).resolve().parent / "_elastic_worker.py")
PHASE_TIMEOUT = 120.0


def progress(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def agent_args(tmp_path: Path, port: int, *extra: str) -> list[str]:
    return [*RDZV_RUN, "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "tcp",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
            "--rdzv-conf", "last_call_timeout=1", "--local-addr", "127.0.0.1",
            "--log-dir", str(tmp_path / "logs"), "--stop-timeout", "5", *extra]


@pytest.mark.timeout(600)
def test_a_join_and_a_graceful_leave_switch_in_process(launcher: Launcher,
                                                       tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    args = agent_args(tmp_path, free_port()) + [
        EXAMPLE, "--steps", "500", "--checkpoint", str(tmp_path / "model.ckpt"),
        "--progress", str(log), "--log-every", "1", "--save-every", "50", "--step-sleep", "0.03",
    ]
    first = launcher.start(args)
    second = launcher.start(args)

    def steps_at(world_size: int) -> int:
        return sum(1 for e in progress(log) if e["world_size"] == world_size)

    wait_for(lambda: steps_at(2) >= 30, PHASE_TIMEOUT, "30 steps at world size 2")
    third = launcher.start(args)
    wait_for(lambda: steps_at(3) >= 30, PHASE_TIMEOUT, "30 steps at world size 3 after a join")
    before = len(progress(log))
    third.signal(signal.SIGTERM)
    assert third.wait(PHASE_TIMEOUT) == 0, third.output()[-5000:]
    wait_for(lambda: sum(1 for e in progress(log)[before:] if e["world_size"] == 2) >= 20,
             PHASE_TIMEOUT, "20 steps at world size 2 after a graceful leave")
    assert [first.wait(PHASE_TIMEOUT), second.wait(PHASE_TIMEOUT)] == [0, 0], (
        first.output()[-5000:] + second.output()[-5000:])

    entries = progress(log)
    steps = [e["step"] for e in entries]
    assert steps == list(range(1, 501)), "rank 0's steps are not strictly consecutive"
    sizes = [e["world_size"] for e in entries]
    phases = [size for i, size in enumerate(sizes) if i == 0 or sizes[i - 1] != size]
    assert phases == [2, 3, 2], phases
    means, start = [], 0
    for i in range(1, len(entries) + 1):  # the mean loss of each phase goes down
        if i == len(entries) or sizes[i] != sizes[start]:
            means.append(sum(e["loss"] for e in entries[start:i]) / (i - start))
            start = i
    assert means == sorted(means, reverse=True), means
    assert entries[-1]["loss"] < entries[0]["loss"] / 4

    text = first.output()
    # One worker process for the whole run: no restart on this node.
    assert len(re.findall(r"started 1 worker\(s\)", text)) == 1, text
    switch_steps = [int(s) for s in re.findall(r"switched in \d+ ms at step (\d+)", text)]
    assert len(switch_steps) == 2, text
    for step, size in zip(switch_steps, (3, 2)):  # all_reduce over the new group after a switch
        assert f"world size {size} at step {step}: parameters identical on all ranks" in text
    assert "DIFFERENT" not in text
    assert "node(s) waiting to join: forming the next round in the background" in text
    assert "node(s) leaving: forming the next round in the background" in text
    assert "done: 500 steps" in text
    leaving = third.output()
    assert "SIGTERM received: leaving the job" in leaving
    assert f"its workers left at step {switch_steps[1]}; exiting" in leaving
    assert "joining the running group at its step" in leaving
    # The newcomer got model, optimizer and step from a peer, not from the checkpoint.
    assert (f"starting at step {switch_steps[0]} with world size 3 (joined a running job)"
            in leaving)


@pytest.mark.timeout(600)
def test_a_worker_that_misses_the_switch_makes_the_agents_restart(launcher: Launcher,
                                                                  tmp_path: Path) -> None:
    stall = tmp_path / "stall"
    args = agent_args(tmp_path, free_port(), "--switch-timeout", "3", "--max-restarts", "3") + [
        WORKER, "--steps", "300", "--stall-file", str(stall), "--stall-rank", "1",
        "--stall-seconds", "30",
    ]
    first = launcher.start(args)
    second = launcher.start(args)
    wait_for(lambda: "step 20 world_size 2" in first.output(), PHASE_TIMEOUT, "20 steps")
    stall.touch()
    wait_for(lambda: "rank 1 stalls" in first.output() + second.output(), PHASE_TIMEOUT,
             "the stall")
    third = launcher.start(args)
    codes = [first.wait(PHASE_TIMEOUT * 2), second.wait(PHASE_TIMEOUT), third.wait(PHASE_TIMEOUT)]
    outputs = first.output() + second.output() + third.output()
    assert codes == [0, 0, 0], outputs[-8000:]
    assert "did not switch within 3 s (--switch-timeout)" in outputs, outputs[-8000:]
    assert "restarting the workers in the new round" in outputs
    assert "done: 300 steps" in first.output()


def test_elastic_state_outside_a_launcher_says_what_to_do() -> None:
    code = "import rdzv.torch; rdzv.torch.ElasticState()"
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert ("ElasticState needs torch.distributed started first: call "
            "rdzv.torch.init_process_group() in a worker started by `rdzv run` or torchrun"
            ) in result.stderr


def test_init_outside_a_launcher_says_what_to_do() -> None:
    code = "import rdzv.torch; rdzv.torch.init_process_group('gloo')"
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert "RANK is not set" in result.stderr and "rdzv run" in result.stderr
    assert sys.executable
