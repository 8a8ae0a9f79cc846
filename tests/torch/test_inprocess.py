"""Membership changes without restarting the workers: real agents, real torch (gloo, CPU).

Under ``rdzv run`` a training loop on ``rdzv.torch.ElasticState`` goes on through a join and a
graceful leave: the workers of the running nodes keep their processes, switch to the new group
at one step, and rank 0's steps stay strictly consecutive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _launcher import EXAMPLES, PYTHON, RDZV_RUN, Launcher, free_port
from _waiting import eventually as wait_for

EXAMPLE = str(EXAMPLES / "elastic_train.py")
WORKER = str(Path(__file__).resolve().parent / "_elastic_worker.py")
PHASE_TIMEOUT = 120.0
TOOK = r"\d+ ms(?: \([^)]*\))?"
"""How long an agent says a transition took (where the time went if it was long), in a regex."""


def progress(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def agent_args(tmp_path: Path, port: int, *extra: str) -> list[str]:
    return [*RDZV_RUN, "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "tcp",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
            "--rdzv-conf", "last_call_timeout=1", "--local-addr", "127.0.0.1",
            "--log-dir", str(tmp_path / "logs"), "--stop-timeout", "5", *extra]


def example_args(tmp_path: Path, log: Path, steps: int, *agent_extra: str) -> list[str]:
    """An agent running the example, rank 0 logging every step to ``log``."""
    return agent_args(tmp_path, free_port(), *agent_extra) + [
        EXAMPLE, "--steps", str(steps), "--checkpoint", str(tmp_path / "model.ckpt"),
        "--progress", str(log), "--log-every", "1", "--save-every", "50", "--step-sleep", "0.03",
    ]


def start_nodes(launcher: Launcher, args: list[str], count: int,
                env: dict[str, str] | None = None) -> list[Any]:
    """``count`` agents; the first is up (serving the tcp store) before the others start."""
    first = launcher.start(args, env)
    wait_for(lambda: "waiting for nodes" in first.output(), PHASE_TIMEOUT, "the first agent")
    return [first] + [launcher.start(args, env) for _ in range(count - 1)]


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
    switch_steps = [int(s) for s in re.findall(rf"switched in {TOOK} at step (\d+)", text)]
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
    assert "the workers joined the running group in" in leaving
    # The newcomer got model, optimizer and step from a peer, not from the checkpoint.
    assert (f"starting at step {switch_steps[0]} with world size 3 (joined a running job)"
            in leaving)


@pytest.mark.timeout(600)
def test_a_worker_that_misses_the_switch_makes_the_agents_restart(launcher: Launcher,
                                                                  tmp_path: Path) -> None:
    stall = tmp_path / "stall"
    args = agent_args(tmp_path, free_port(), "--switch-timeout", "3", "--max-restarts", "3") + [
        WORKER, "--steps", "150", "--stall-file", str(stall), "--stall-rank", "1",
        "--stall-seconds", "60",  # past the join (seconds under load), the switch and the abort's
    ]                             # grace: the stall ends only with the worker
    first = launcher.start(args)
    second = launcher.start(args)
    wait_for(lambda: "step 20 world_size 2" in first.output(), PHASE_TIMEOUT, "20 steps")
    stall.touch()
    wait_for(lambda: "rank 1 stalls" in first.output() + second.output(), PHASE_TIMEOUT,
             "the stall")
    stall.unlink()  # one stall: the worker started in its place trains on
    third = launcher.start(args)
    codes = [first.wait(PHASE_TIMEOUT * 2), second.wait(PHASE_TIMEOUT), third.wait(PHASE_TIMEOUT)]
    outputs = first.output() + second.output() + third.output()
    assert codes == [0, 0, 0], outputs[-8000:]
    assert "did not enter the new group within 3 s (--switch-timeout)" in outputs, outputs[-8000:]
    # the stalled worker is restarted: with every worker (transitions that keep failing), or
    # alone (it did not leave the aborted group within the abort's grace and ended itself)
    assert re.search(r"restarting (the workers|it alone) \(restart [1-3] of 3\)", outputs), (
        outputs[-8000:])
    assert "done: 150 steps" in first.output()


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


def phases(entries: list[dict[str, Any]], since: int = 0) -> list[int]:
    """The world sizes rank 0 trained at, in order, from its first step at world size ``since``
    (with --nnodes 1:3 a node slow to start may join a switch after the others began)."""
    sizes = [e["world_size"] for e in entries]
    sizes = sizes[next((i for i, size in enumerate(sizes) if size == since), 0):]
    return [size for i, size in enumerate(sizes) if i == 0 or sizes[i - 1] != size]


@pytest.mark.timeout(600)
def test_a_killed_node_is_survived_in_process_and_replaced(launcher: Launcher,
                                                           tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    args = example_args(tmp_path, log, 450, "--max-restarts", "0")
    # Past its 450 steps, the job trains on until three nodes have trained 100 steps in one group
    # (on a loaded machine the workers' starts, torch's import, can outlast the steps: the first
    # group of three may come after step 450, and must last past the 20 steps before the kill)
    finish = {"RDZV_EXAMPLE_FINISH_WITH": "3:100"}
    first, second, victim = start_nodes(launcher, args, 3, finish)

    def steps_at(world_size: int, after: int = 0) -> int:
        return sum(1 for e in progress(log)[after:] if e["world_size"] == world_size)

    wait_for(lambda: steps_at(3) >= 20, PHASE_TIMEOUT, "20 steps at world size 3")
    before = len(progress(log))
    os.killpg(victim.pid, signal.SIGKILL)  # the agent and its worker, mid-step
    victim.wait(PHASE_TIMEOUT)
    wait_for(lambda: steps_at(2, before) >= 20, PHASE_TIMEOUT, "20 steps at 2 after the kill")
    before = len(progress(log))
    replacement = launcher.start(args, finish)
    wait_for(lambda: steps_at(3, before) >= 20, PHASE_TIMEOUT, "20 steps at 3 after a join")
    codes = [node.wait(PHASE_TIMEOUT) for node in (first, second, replacement)]
    outputs = first.output() + second.output() + replacement.output()
    assert codes == [0, 0, 0], outputs[-8000:]

    text = first.output()
    # --max-restarts 0 and one worker process on each surviving node: nothing restarted.
    for node in (first, second):
        assert len(re.findall(r"started 1 worker\(s\)", node.output())) == 1, node.output()
    assert re.search(rf"recovered in-process in {TOOK} at step \d+", text), text
    assert "member(s) of the round lost" in text or "process group failed" in text
    entries = progress(log)
    assert entries[-1]["step"] >= 450
    assert phases(entries)[-3:] == [3, 2, 3], phases(entries)
    steps = [e["step"] for e in entries]
    jumps = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
    # At most one step redone (the failed one, by the survivors that had not finished it) or
    # one left unlogged by rank 0 (finished by a survivor rank 0 adopted).
    assert len(jumps) <= 1 and all(b in (a, a + 2) for a, b in jumps), jumps
    assert "DIFFERENT" not in text and text.count("parameters identical on all ranks") >= 3
    losses = [e["loss"] for e in entries]
    assert losses[-1] < losses[0] / 4


def worker_pid(agent_pid: int) -> int:
    """The worker process an agent of ``--nproc-per-node 1`` runs now."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.timeout(600)
def test_a_hung_node_is_dropped_after_its_heartbeat_bound(launcher: Launcher,
                                                          tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    args = example_args(tmp_path, log, 250, "--max-restarts", "0")
    args[args.index("last_call_timeout=1")] = "last_call_timeout=1,heartbeat_interval=1,heartbeat_misses=3"
    # Past its 250 steps, the job trains on until two nodes have trained 150 steps in one group:
    # on a loaded machine the first round can form with the first node alone, and the others'
    # workers' starts (torch's import) outlast its 250 steps (CI: it ended before them)
    first, second, hung = start_nodes(launcher, args, 3, {"RDZV_EXAMPLE_FINISH_WITH": "2:150"})
    wait_for(lambda: sum(e["world_size"] == 3 for e in progress(log)) >= 20, PHASE_TIMEOUT,
             "20 steps at world size 3")
    # (a node that joins before the others' workers can switch restarts them: count from here)
    starts = first.output().count("started 1 worker(s)")
    stopped = [hung.pid, worker_pid(hung.pid)]
    for pid in stopped:  # the whole node hangs: agent and worker
        os.kill(pid, signal.SIGSTOP)
    try:
        assert [first.wait(PHASE_TIMEOUT), second.wait(PHASE_TIMEOUT)] == [0, 0], (
            first.output()[-5000:] + second.output()[-5000:])
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)
    entries = progress(log)
    assert phases(entries, since=3) == [3, 2] and entries[-1]["step"] >= 250, phases(entries)
    gaps = [b["time"] - a["time"] for a, b in zip(entries, entries[1:])]
    assert max(gaps) < 3 + 30, gaps  # the heartbeat bound, not the group's 10 minutes
    text = first.output()
    assert text.count("started 1 worker(s)") == starts, text  # the hang cost no restart
    assert re.search(r"recovered in-process in \d+ ms", text), text


@pytest.mark.timeout(600)
def test_survivors_below_min_nodes_wait_and_resume_in_process(launcher: Launcher,
                                                              tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    args = example_args(tmp_path, log, 200, "--max-restarts", "0")
    args[args.index("1:3")] = "2:3"
    # Once the returning node is in, the survivor trains on while the newcomer's worker starts;
    # past its 200 steps, the job trains on until that worker has joined (its start can outlast
    # the steps left on a loaded machine).
    finish = {"RDZV_EXAMPLE_FINISH_WITH": "2:10"}
    first, victim = start_nodes(launcher, args, 2, finish)
    wait_for(lambda: len(progress(log)) >= 20, PHASE_TIMEOUT, "20 steps at world size 2")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(PHASE_TIMEOUT)
    wait_for(lambda: "the survivors wait for enough nodes" in first.output(), PHASE_TIMEOUT,
             "the survivor saying that it waits")
    steps_before = len(progress(log))
    returning = launcher.start(args, env=finish)
    assert [first.wait(PHASE_TIMEOUT), returning.wait(PHASE_TIMEOUT)] == [0, 0], (
        first.output()[-5000:] + returning.output()[-5000:])
    text = first.output()
    assert len(re.findall(r"started 1 worker\(s\)", text)) == 1, text  # the same worker
    assert re.search(r"recovered in-process in \d+ ms", text), text
    entries = progress(log)
    assert len(entries) > steps_before and entries[-1]["step"] >= 200
    assert entries[-1]["world_size"] == 2, entries[-1]  # the returning node trained too
    assert "joined a running job" in returning.output(), returning.output()


@pytest.mark.timeout(600)
def test_a_crashed_worker_rejoins_from_a_peer_while_the_others_recover(launcher: Launcher,
                                                                       tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    args = example_args(tmp_path, log, 250, "--max-restarts", "1")
    # Past its 250 steps, the job trains on until the three nodes have trained 100 steps in one
    # group (on a loaded machine the workers' starts, torch's import, outlast the steps left):
    # time for the crash after 20 steps, and for the restarted worker to join and train.
    first, second, crashing = start_nodes(launcher, args, 3, {"RDZV_EXAMPLE_FINISH_WITH": "3:100"})
    wait_for(lambda: sum(e["world_size"] == 3 for e in progress(log)) >= 20, PHASE_TIMEOUT,
             "20 steps at world size 3")
    os.kill(worker_pid(crashing.pid), signal.SIGKILL)  # the worker alone; its node survives
    codes = [node.wait(PHASE_TIMEOUT) for node in (first, second, crashing)]
    assert codes == [0, 0, 0], "".join(n.output()[-4000:] for n in (first, second, crashing))
    for node in (first, second):
        assert len(re.findall(r"started 1 worker\(s\)", node.output())) == 1, node.output()
    assert re.search(r"recovered in-process in \d+ ms", first.output()), first.output()
    again = crashing.output()
    assert "restarting it alone (restart 1 of 1)" in again, again
    assert "joined a running job" in again, again  # the state came from a peer
    entries = progress(log)
    # The others recover without it at once (world size 2), and it joins once warm (3).
    assert entries[-1]["step"] >= 250 and phases(entries, since=3) == [3, 2, 3], phases(entries)
    steps = [e["step"] for e in entries]
    jumps = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
    assert len(jumps) <= 1 and all(b in (a, a + 2) for a, b in jumps), jumps


@pytest.mark.timeout(300)
def test_sigterm_to_every_node_at_once_ends_the_job_within_seconds(launcher: Launcher,
                                                                    tmp_path: Path) -> None:
    """Slurm's scancel of a whole job: SIGTERM to every process of every node at once. The node
    that hosts the store stops at once (the others cannot go on without it); the others, which
    could each have left gracefully, see that nothing listens at the store any more and stop
    within about a second, not after the leave grace (30 s) or the store's timeout."""
    log = tmp_path / "progress.jsonl"
    nodes = start_nodes(launcher, example_args(tmp_path, log, 100_000), 3)
    # (steady training: a node whose main thread waits on the store in a transition when the
    # store goes takes the store's read_timeout to see it; docs/clusters.md says so)
    wait_for(lambda: sum(e["world_size"] == 3 for e in progress(log)) >= 20, PHASE_TIMEOUT,
             "20 steps at world size 3")
    started = time.monotonic()
    for node in nodes:  # (each agent leads its own process group, with its workers)
        os.killpg(node.pid, signal.SIGTERM)
    codes = [node.wait(30) for node in nodes]
    took = time.monotonic() - started
    outputs = [node.output() for node in nodes]
    assert took < 10, (took, [text[-3000:] for text in outputs])
    assert codes[0] == 128 + signal.SIGTERM, outputs[0][-3000:]
    assert "this node serves the rendezvous store (is_host)" in outputs[0]
    for code, text in zip(codes[1:], outputs[1:]):
        assert "Traceback" not in text, text[-3000:]
        assert code == 0 or "nothing listens at 127.0.0.1:" in text, (code, text[-3000:])
