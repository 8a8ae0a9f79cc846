"""Sharded training (FSDP2 within each node, replicas across nodes) through membership changes:
real agents, real torch (gloo, CPU), two workers per node forked from a worker template that
imported torch (``--preload torch``), ``examples/elastic_fsdp.py``.

Under ``rdzv run`` a join, a graceful leave and a killed node are each made in-process: no worker
restarts, every change is followed by a check (a collective) that the replicas agree, rank 0's
steps stay consecutive (at most one redone for the kill) and the loss keeps going down. Under
torchrun the same script restarts and resumes from its DCP checkpoint, also on another number
of nodes.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from _launcher import EXAMPLES, PYTHON, RDZV_RUN, Launcher, free_port
from _waiting import eventually as wait_for
from test_inprocess import TOOK

EXAMPLE = str(EXAMPLES / "elastic_fsdp.py")
PRELOAD = ("--preload", "torch")
"""Each node's two workers are forked from a template that imported torch once (as on a node
of 8 GPUs, where 8 imports at once are what a start costs): sharded training, its in-process
changes and its restarts all run in forked workers here."""
PHASE_TIMEOUT = 150.0


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rdzv_run(tmp_path: Path, port: int, nnodes: str, steps: int, restarts: int = 0) -> list[str]:
    """An agent of two workers running the example; the first round waits 5 s for more nodes.
    Steps of ~0.2 s (a FSDP2 step costs a worker ~25 ms of CPU here): the running workers leave
    the CPU to the newcomers' starts, which set each test's pace."""
    return [*RDZV_RUN, "--nnodes", nnodes, "--nproc-per-node", "2", *PRELOAD, "--rdzv-backend", "tcp",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hsdp",
            "--rdzv-conf", "last_call_timeout=5", "--local-addr", "127.0.0.1",
            "--log-dir", str(tmp_path / "logs"), "--stop-timeout", "5", "--max-restarts", str(restarts),
            EXAMPLE, "--steps", str(steps), "--checkpoint", str(tmp_path / "ckpt"),
            "--progress", str(tmp_path / "progress.jsonl"), "--checks",
            str(tmp_path / "checks.jsonl"), "--log-every", "1", "--save-every", "1000",
            "--step-sleep", "0.15"]


def phase(condition: Any, what: str, *nodes: Any) -> None:
    """Wait for ``condition``; past :data:`PHASE_TIMEOUT` fail with what the nodes said."""
    try:
        wait_for(condition, PHASE_TIMEOUT, what)
    except AssertionError as exc:
        said = "\n".join(f"--- node {i}:\n{node.output()[-4000:]}" for i, node in enumerate(nodes))
        raise AssertionError(f"{exc}\n{said}") from None


@pytest.mark.timeout(900)
def test_sharded_training_survives_a_join_a_leave_and_a_kill_in_process(
        launcher: Launcher, tmp_path: Path) -> None:
    log, checks = tmp_path / "progress.jsonl", tmp_path / "checks.jsonl"
    # more steps than the changes take even under load (a join there has outlasted 270 steps
    # of two nodes); the job is ended once the last change is checked, as scancel would
    args = rdzv_run(tmp_path, free_port(), "1:3", 100_000)
    first = launcher.start(args)  # it serves the store: the others may leave or die
    wait_for(lambda: "waiting for nodes" in first.output(), PHASE_TIMEOUT, "the first agent")
    second = launcher.start(args)

    def steps_at(world_size: int, after: int = 0) -> int:
        return sum(1 for e in lines(log)[after:] if e["world_size"] == world_size)

    phase(lambda: steps_at(4) >= 10, "10 steps of 2 nodes", first, second)
    third = launcher.start(args)
    phase(lambda: steps_at(6) >= 10, "10 steps of 3 nodes after a join", first, second, third)
    before = len(lines(log))
    second.signal(signal.SIGTERM)  # the agent only: its workers train on until the switch
    assert second.wait(PHASE_TIMEOUT) == 0, second.output()[-5000:]
    phase(lambda: steps_at(4, before) >= 10, "10 steps after a graceful leave", first, third)
    before = len(lines(log))
    os.killpg(third.pid, signal.SIGKILL)  # the agent and both its workers, mid-step
    third.wait(PHASE_TIMEOUT)
    phase(lambda: steps_at(2, before) >= 10 and len(lines(checks)) >= 4,
          "10 steps and a check after the kill", first)
    first.signal(signal.SIGTERM)  # the last node, alone: it stops its workers and ends
    assert first.wait(PHASE_TIMEOUT) == 128 + signal.SIGTERM, first.output()[-8000:]

    text = first.output()
    # --max-restarts 0 and one start of the node's two workers: nothing restarted.
    assert len(re.findall(r"started 2 worker\(s\)", text)) == 1, text
    switches = [int(s) for s in re.findall(rf"switched in {TOOK} at step (\d+)", text)]
    recoveries = [int(s) for s in re.findall(rf"recovered in-process in {TOOK} at step (\d+)",
                                             text)]
    assert len(switches) == 2 and len(recoveries) == 1, text
    assert "restarting" not in text
    # After every change the replicas agree (checked by a collective of every worker).
    checked = lines(checks)
    assert [c["world_size"] for c in checked] == [4, 6, 4, 2], checked
    assert all(c["agree"] for c in checked), checked
    assert [c["step"] for c in checked[1:3]] == switches
    # The newcomer's workers received their shards from a running node, not from disk.
    # (a newcomer's lines carry its rank once the switch is done, "joining i" before)
    assert re.search(r"\[(?:[45]|joining [01])\]:starting at step \d+ with world size 6 "
                     r"\(joined a running job\)",
                     third.output()), third.output()[-5000:]
    entries = lines(log)
    steps = [e["step"] for e in entries]
    jumps = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
    # Consecutive through the join and the leave; at most one step redone (or finished by a
    # survivor rank 0 adopted) for the kill.
    assert len(jumps) <= 1 and all(b in (a, a + 2) for a, b in jumps), jumps
    assert all(a > switches[-1] for a, _ in jumps), (jumps, switches)
    losses = [e["loss"] for e in entries]
    assert losses[-1] < losses[0] / 4, (losses[0], losses[-1])
    assert "DIFFERENT" not in text


@pytest.mark.timeout(600)
def test_sharded_checkpoint_resumes_under_torchrun_and_on_more_nodes(
        launcher: Launcher, tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "ckpt")
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--rdzv-backend", "rdzv-tcp", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                "--rdzv-id", "train", "--local-addr", "127.0.0.1", "--max-restarts", "1",
                "--monitor-interval", "0.2", EXAMPLE, "--steps", "60", "--checkpoint",
                checkpoint, "--log-every", "5", "--save-every", "10", "--step-sleep", "0.05"]
    agent = launcher.start(torchrun)
    wait_for(lambda: "step 25 world_size 2" in agent.output(), PHASE_TIMEOUT, "25 steps")
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    os.kill(int(children[-1]), signal.SIGKILL)  # a worker: torchrun restarts both
    assert agent.wait(PHASE_TIMEOUT) == 0, agent.output()[-5000:]
    text = agent.output()
    resumed = re.search(r"starting at step (\d+) with world size 2 \(restart 1\)", text)
    assert resumed and int(resumed.group(1)) >= 20 and int(resumed.group(1)) % 10 == 0, text
    assert "done: 60 steps" in text

    # The same checkpoint, written by one node, loads into two (rdzv run, in-process mode).
    args = rdzv_run(tmp_path, free_port(), "2", 80)
    nodes = [launcher.start(args) for _ in range(2)]
    assert [node.wait(PHASE_TIMEOUT) for node in nodes] == [0, 0], (
        nodes[0].output()[-5000:] + nodes[1].output()[-5000:])
    text = nodes[0].output() + nodes[1].output()
    assert "starting at step 60 with world size 4 (restart 0)" in text, text
    assert "world size 4 at step 60: replicas identical on all nodes" in text
    assert "done: 80 steps" in text


@pytest.mark.timeout(600)
def test_a_crashed_worker_restarts_with_its_node_and_rejoins_from_a_replica(
        launcher: Launcher, tmp_path: Path) -> None:
    log, checks = tmp_path / "progress.jsonl", tmp_path / "checks.jsonl"
    # Past its 80 steps, the job trains on until both nodes have trained 10 steps in one group:
    # time for the node's two new workers to start and join (16 s on a loaded machine); the
    # 65 steps after the 15th (~13 s) are the test's time to kill the worker
    args = rdzv_run(tmp_path, free_port(), "2", 80, restarts=1)
    finish = {"RDZV_EXAMPLE_FINISH_WITH": "4:10"}
    first = launcher.start(args, finish)
    wait_for(lambda: "waiting for nodes" in first.output(), PHASE_TIMEOUT, "the first agent")
    second = launcher.start(args, finish)
    wait_for(lambda: len(lines(log)) >= 15, PHASE_TIMEOUT, "15 steps of 2 nodes")
    workers = re.findall(r"started 2 worker\(s\) \(pids (\d+), (\d+)\)", second.output())[0]
    os.kill(int(workers[1]), signal.SIGKILL)  # one worker of the second node (local rank 1)
    assert [first.wait(PHASE_TIMEOUT * 2), second.wait(PHASE_TIMEOUT)] == [0, 0], (
        first.output()[-5000:] + second.output()[-8000:])

    crashed = second.output()
    assert ("local rank 1 ended with signal SIGKILL: restarting the node's 2 workers, which "
            "shard the model together (restart 1 of 1)") in crashed, crashed[-5000:]
    # Both its workers joined the running job again and received their shards from the first.
    assert len(re.findall(r"\[(?:[23]|joining [01])\]:starting at step \d+ with world size 4 "
                          r"\(joined a running job\)", crashed)) == 2, crashed[-5000:]
    text = first.output()
    assert len(re.findall(r"started 2 worker\(s\)", text)) == 1, text  # the first: no restart
    assert re.search(rf"recovered in-process in {TOOK} at step \d+: 2 node\(s\), world size 2",
                     text), text
    checked = lines(checks)
    assert [c["world_size"] for c in checked] == [4, 2, 4], checked
    assert all(c["agree"] for c in checked), checked
    steps = [e["step"] for e in lines(log)]
    jumps = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
    assert len(jumps) <= 1 and all(b in (a, a + 2) for a, b in jumps), jumps
    assert steps[-1] >= 80 and checked[-1]["step"] <= steps[-1] - 10, (checked, steps[-1])


@pytest.mark.timeout(600)
def test_a_recovery_taken_between_steps_frees_a_local_peer_waiting_in_the_next_step(
        launcher: Launcher, tmp_path: Path) -> None:
    """A node's workers leave a step at different points: local rank 0 sleeps after its
    optimizer step (slow data loading) while local rank 1 already waits for it in the next
    step's all-gather over the node's group. The other node is killed then: local
    rank 0 takes the recovery at its step's end, and local rank 1, whose wait no abort of the
    job's group reaches, must be freed to recover too (not end itself, which would restart the
    node's workers: --max-restarts 0 fails the job instead)."""
    slow = tmp_path / "slow"
    args = [*RDZV_RUN, "--nnodes", "1:2", "--nproc-per-node", "2", *PRELOAD, "--rdzv-backend", "tcp",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "hsdp-slow",
            "--rdzv-conf", "last_call_timeout=5", "--local-addr", "127.0.0.1",
            "--stop-timeout", "5", "--max-restarts", "0", str(Path(__file__).parent /
                                                              "_hsdp_worker.py"),
            "--steps", "100", "--slow-file", str(slow), "--slow-seconds", "2"]
    first = launcher.start(args)  # it serves the store, and stays
    wait_for(lambda: "waiting for nodes" in first.output(), PHASE_TIMEOUT, "the first agent")
    second = launcher.start(args)
    phase(lambda: "step 10 world_size 4" in first.output() + second.output(),
          "10 steps of 2 nodes", first, second)

    def slept() -> int:
        return len(re.findall(r"sleeps 2\.0 s after step", first.output()))

    slow.touch()
    phase(lambda: slept() >= 3, "three slow steps", first, second)  # (step times of 2 s)
    seen = slept()
    phase(lambda: slept() > seen, "the next slow step", first, second)
    os.killpg(second.pid, signal.SIGKILL)  # the other node: its agent and workers
    slow.unlink()
    second.wait(PHASE_TIMEOUT)
    assert first.wait(PHASE_TIMEOUT) == 0, first.output()[-8000:]

    text = first.output()
    assert len(re.findall(r"started 2 worker\(s\)", text)) == 1, text[-8000:]
    assert re.search(rf"recovered in-process in {TOOK} at step \d+: 1 node\(s\), world size 2",
                     text), text[-8000:]
    assert "ends itself" not in text, text[-8000:]
    assert "world size 2 at step" in text and "DIFFERENT" not in text, text[-8000:]
    assert "done: 100 steps" in text, text[-8000:]


@pytest.mark.timeout(600)
def test_a_newcomer_node_sets_up_before_the_running_workers_pause_and_restarts_as_one(
        launcher: Launcher, tmp_path: Path) -> None:
    """A newcomer node's workers set up (shard the model over their node, make the optimizer,
    and here 4 s more of a slow set-up) in a provisional group of their own, and only then ask
    to join: the running workers switch in well under those 4 s, where they used to wait in the
    switch for the newcomer's set-up. One of them SIGKILLed while they set up takes its node's
    other worker with it: both start again in a new provisional group and join; the running
    nodes never restart and never wait for the dead one."""
    args = [*RDZV_RUN, "--nnodes", "2:3", "--nproc-per-node", "2", *PRELOAD, "--rdzv-backend", "tcp",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "hsdp-setup",
            "--rdzv-conf", "last_call_timeout=5", "--local-addr", "127.0.0.1",
            "--stop-timeout", "5", "--max-restarts", "1", str(Path(__file__).parent /
                                                              "_hsdp_worker.py"),
            "--steps", "100000", "--setup-seconds", "4"]
    nodes = [launcher.start(args), launcher.start(args)]
    phase(lambda: "step 10 world_size 4" in nodes[0].output() + nodes[1].output(),
          "10 steps of 2 nodes", *nodes)
    third = launcher.start(args)
    nodes.append(third)
    setting_up = r"pid (\d+) sets up for 4\.0 s"
    phase(lambda: re.search(setting_up, third.output()), "the newcomer's set-up", *nodes)
    os.kill(int(re.findall(setting_up, third.output())[0]), signal.SIGKILL)
    joined = r"switched in (\d+) ms(?: \([^)]*\))? at step (\d+): 3 node\(s\), world size 6"
    phase(lambda: re.search(joined, nodes[0].output()), "the join", *nodes)
    phase(lambda: "world size 6 at step" in nodes[0].output(), "the check after the join",
          *nodes)
    texts = [node.output() for node in nodes]
    for node in nodes:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(PHASE_TIMEOUT)
    assert "restarting the node's 2 workers, which set up to join together" in texts[2], \
        texts[2][-8000:]
    assert "the workers joined the running group" in texts[2], texts[2][-8000:]
    match = re.search(joined, texts[0])
    assert match and int(match.group(1)) < 2000, texts[0][-8000:]
    assert re.search(rf"world size 6 at step {match.group(2)}: replicas identical", texts[0]), \
        texts[0][-8000:]
    assert len(re.findall(r"started 2 worker\(s\)", texts[0])) == 1, texts[0][-8000:]
    assert "restarting" not in texts[0] + texts[1], texts[0][-8000:]
