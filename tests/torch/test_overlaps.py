"""Faults that overlap a transition, with real agents, real torch (gloo) and a standalone store
server: the three failure modes of issue 22, each resolved in-process, at once, in one world.

* a node lost while a join's round forms: nobody waits out ``--switch-timeout`` for it;
* a crashed worker on the node of group rank 0 (global rank 0): it is restarted alone, no other
  node restarts anything;
* a worker whose parameters differ from the others' at a change of group (what a mixed
  decision left behind): the group's agreement on entering brings it back, nobody trains on
  with parameters that differ;
* a node that joins while the first workers still start (import torch): it joins in-process
  once they connect, nobody restarts;
* a node stopped (agent and workers) while every worker starts: the others restart theirs at
  once in a group without it, not after the connect timeout;
* a node lost while a worker of another is stuck where the abort does not reach it (gloo can
  wait on a closed peer): its agent leaves it out, and the others recover without it at once;
* a newcomer whose program cannot hold the job's state: it leaves with an error, the others
  recover without it in-process (no restart, the run stays open).
"""

from __future__ import annotations

import os
import re
import subprocess
import signal
from pathlib import Path
from typing import Any

import pytest
from _launcher import PYTHON, RDZV_RUN, LoggedProcess, Launcher, free_port
from _waiting import eventually as wait_for
from test_inprocess import EXAMPLE, PHASE_TIMEOUT, WORKER, phases, progress, worker_pid

SWITCH_TIMEOUT = 40
"""Far above every pause asked for: a transition that waits for it shows."""


def serve(launcher: Launcher) -> int:
    port = free_port()
    server = launcher.start([PYTHON, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                             "--port", str(port)])
    wait_for(lambda: "listening on" in server.output(), PHASE_TIMEOUT, "the store server")
    return port


def agent_args(tmp_path: Path, port: int, program: list[str]) -> list[str]:
    return [*RDZV_RUN, "--nnodes", "2:4", "--nproc-per-node", "1", "--rdzv-backend", "tcp",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
            "--rdzv-conf", "last_call_timeout=1,is_host=0", "--local-addr", "127.0.0.1",
            "--log-dir", str(tmp_path / "logs"), "--stop-timeout", "5", "--max-restarts", "3",
            "--switch-timeout", str(SWITCH_TIMEOUT), *program]


def example(tmp_path: Path, steps: int) -> list[str]:
    return [EXAMPLE, "--steps", str(steps), "--checkpoint", str(tmp_path / "model.ckpt"),
            "--progress", str(tmp_path / "progress.jsonl"), "--log-every", "1",
            "--save-every", "50", "--step-sleep", "0.03"]


def started_once(node: LoggedProcess) -> bool:
    return len(re.findall(r"started 1 worker\(s\)", node.output())) == 1


def longest_pause(entries: list[dict[str, Any]]) -> float:
    return max(b["time"] - a["time"] for a, b in zip(entries, entries[1:]))


@pytest.mark.timeout(600)
def test_a_node_lost_while_a_join_forms_costs_no_switch_timeout(launcher: Launcher,
                                                                tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    args = agent_args(tmp_path, serve(launcher), example(tmp_path, 400))
    # past its 400 steps, the job trains on until the newcomer has joined and trained 10 steps
    # (on a loaded machine its worker's start has outlasted the steps left)
    finish = {"RDZV_EXAMPLE_FINISH_WITH": "3:10"}
    a, b, c = (launcher.start(args, env=finish) for _ in range(3))
    wait_for(lambda: sum(e["world_size"] == 3 for e in progress(log)) >= 20, PHASE_TIMEOUT,
             "20 steps at world size 3")
    before = len(progress(log))
    d = launcher.start(args, env=finish)  # a newcomer: the next round forms while it warms up
    wait_for(lambda: "started 1 worker(s)" in d.output(), PHASE_TIMEOUT, "the newcomer warming")
    os.killpg(c.pid, signal.SIGKILL)  # a member of the forming round dies, agent and worker
    c.wait(PHASE_TIMEOUT)
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in (a, b, d)]
    outputs = "".join(node.output()[-6000:] for node in (a, b, d))
    assert codes == [0, 0, 0], outputs
    entries = progress(log)[before:]
    assert entries[-1]["step"] >= 400 and phases(entries)[-1] == 3, phases(entries)
    assert longest_pause(entries) < 5.0, outputs  # not the --switch-timeout of 40 s
    for node in (a, b):  # in-process: the same worker all along
        assert started_once(node) and "restarting the workers" not in node.output(), outputs
    assert "DIFFERENT" not in outputs and "joined a running job" in d.output(), outputs


@pytest.mark.timeout(600)
def test_a_crashed_worker_of_global_rank_0_is_restarted_alone(launcher: Launcher,
                                                              tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    args = agent_args(tmp_path, serve(launcher), example(tmp_path, 300))
    # past its 300 steps, the job trains on until the restarted worker has joined and trained
    # 20 steps (on a loaded machine its start has outlasted the steps left)
    nodes = [launcher.start(args, env={"RDZV_EXAMPLE_FINISH_WITH": "3:20"}) for _ in range(3)]
    wait_for(lambda: sum(e["world_size"] == 3 for e in progress(log)) >= 20, PHASE_TIMEOUT,
             "20 steps at world size 3")
    first = next(n for n in nodes if "this node is group rank 0 with global ranks 0..0"
                 in n.output())
    before = len(progress(log))
    os.kill(worker_pid(first.pid), signal.SIGKILL)  # the worker alone; its node survives
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in nodes]
    outputs = "".join(node.output()[-6000:] for node in nodes)
    assert codes == [0, 0, 0], outputs
    for node in nodes:
        if node is not first:  # nobody else restarts anything
            assert started_once(node) and "restarting the workers" not in node.output(), outputs
    assert "restarting it alone (restart 1 of 3)" in first.output(), outputs
    assert "joined a running job" in first.output(), outputs
    entries = progress(log)[before:]
    assert entries[-1]["step"] >= 300 and phases(entries)[-2:] == [2, 3], phases(entries)
    assert longest_pause(entries) < 3.0, outputs  # the others do not wait for it to warm up
    steps = [e["step"] for e in entries]
    jumps = [(x, y) for x, y in zip(steps, steps[1:]) if y != x + 1]
    assert len(jumps) <= 1 and all(y in (x, x + 2) for x, y in jumps), jumps
    assert "DIFFERENT" not in outputs


@pytest.mark.timeout(600)
def test_parameters_that_differ_at_a_change_are_brought_into_agreement(
        launcher: Launcher, tmp_path: Path) -> None:
    perturb = tmp_path / "perturb"
    args = agent_args(tmp_path, serve(launcher), [WORKER, "--steps", "400", "--perturb-file",
                                                  str(perturb), "--perturb-rank", "1"])
    first, second = launcher.start(args), launcher.start(args)
    wait_for(lambda: "step 20 world_size 2" in first.output() + second.output(), PHASE_TIMEOUT,
             "20 steps")
    perturb.touch()  # rank 1 now holds other weights than rank 0: a wrong world
    wait_for(lambda: "rank 1 perturbs its weights" in first.output() + second.output(),
             PHASE_TIMEOUT, "the perturbation")
    third = launcher.start(args)  # a join: every worker changes group
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in (first, second, third)]
    outputs = "".join(node.output() for node in (first, second, third))
    assert codes == [0, 0, 0], outputs[-12000:]
    checks = re.findall(r"world size (\d) at step \d+: weights (\w+)", outputs)
    assert ("3", "identical") in checks and ("3", "DIFFERENT") not in checks, outputs
    assert re.search(r"ranks \[\d\] held other parameters than rank \d at step \d+: they "
                     r"receive its state", outputs), outputs


@pytest.mark.timeout(600)
def test_workers_that_start_from_different_states_agree_before_their_first_step(
        launcher: Launcher, tmp_path: Path) -> None:
    """One node restored an older checkpoint than the other (step 0 against 10): before the
    first step the older one receives the newer state; the job trains on from step 10."""
    args = agent_args(tmp_path, serve(launcher), [WORKER, "--steps", "30", "--step-sleep",
                                                  "0.01", "--stale-rank", "1"])
    nodes = [launcher.start(args) for _ in range(2)]
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in nodes]
    outputs = "".join(node.output() for node in nodes)
    assert codes == [0, 0], outputs[-12000:]
    assert "world size 2 at step 30: weights identical" in outputs, outputs
    assert re.search(r"^\[0\]:step 11 world_size 2 ", outputs, re.M), outputs
    assert not re.search(r"^\[0\]:step [1-9] world_size", outputs, re.M), outputs
    assert ("started from another state than its group's most advanced one (step 0): it "
            "received that one (step 10)") in outputs, outputs


@pytest.mark.timeout(600)
def test_a_node_that_joins_while_the_first_workers_start_is_switched_in(
        launcher: Launcher, tmp_path: Path) -> None:
    """A node joins seconds after the job started, while its first workers still import (slow
    here on purpose): it joins once they connect. A member used to take the first round's
    "nobody runs yet" for "no in-process API", and every worker restarted."""
    args = agent_args(tmp_path, serve(launcher), [WORKER, "--steps", "250", "--step-sleep",
                                                  "0.03", "--import-seconds", "6",
                                                  "--finish-with", "3"])
    first, second = launcher.start(args), launcher.start(args)
    wait_for(lambda: "round complete: 2 node(s)" in first.output(), PHASE_TIMEOUT, "the job")
    third = launcher.start(args)  # (the first workers have 6 s to go before they connect)
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in (first, second, third)]
    outputs = "".join(node.output() for node in (first, second, third))
    assert codes == [0, 0, 0], outputs[-12000:]
    assert "restarting" not in outputs and all(
        started_once(node) for node in (first, second, third)), outputs
    assert "the workers joined the running group in" in third.output(), third.output()
    assert re.search(r"world size 3 at step \d+: weights identical", outputs), outputs


@pytest.mark.timeout(600)
def test_a_node_that_comes_as_the_job_ends_trains_nothing(launcher: Launcher,
                                                          tmp_path: Path) -> None:
    """A node joins; the job ends while its workers start (slow here on purpose): it stops them
    and ends, the others end as they would have. It used to enter a group of its own once warm,
    and train the whole job again alone."""
    # (200 steps: on a loaded machine the newcomer's agent took seconds to start)
    args = agent_args(tmp_path, serve(launcher), [WORKER, "--steps", "200", "--step-sleep",
                                                  "0.03", "--join-seconds", "60"])
    first, second = launcher.start(args), launcher.start(args)
    wait_for(lambda: "step 10 world_size 2" in first.output(), PHASE_TIMEOUT, "10 steps")
    late = launcher.start(args)
    codes = [node.wait(PHASE_TIMEOUT) for node in (first, second, late)]
    outputs = "".join(node.output() for node in (first, second, late))
    assert codes == [0, 0, 0], outputs[-12000:]
    assert "the job finished before this node's workers could join it" in late.output(), (
        late.output())
    assert "done: 200 steps" in first.output() and "world_size 1" not in outputs, outputs
    for node in (first, second):
        assert "every node has finished; this node's workers succeeded" in node.output()


@pytest.mark.timeout(600)
def test_sigterm_to_a_newcomer_setting_up_is_a_leave_not_a_crash(launcher: Launcher,
                                                                 tmp_path: Path) -> None:
    """Slurm's scancel of a node that joins: every process gets SIGTERM, its worker (still
    setting up, so without its handler) dies of it, and its agent may see that before its own
    signal. It used to count a crash: with --max-restarts 0 the whole run failed."""
    args = agent_args(tmp_path, serve(launcher), [WORKER, "--steps", "150", "--step-sleep",
                                                  "0.03", "--join-seconds", "60"])
    args[args.index("--max-restarts") + 1] = "0"
    first, second = launcher.start(args), launcher.start(args)
    wait_for(lambda: "step 10 world_size 2" in first.output(), PHASE_TIMEOUT, "10 steps")
    late = launcher.start(args)
    wait_for(lambda: "to join the running group" in late.output(), PHASE_TIMEOUT,
             "the newcomer's worker")
    os.kill(worker_pid(late.pid), signal.SIGTERM)  # (the worker's first: the order at stake)
    assert late.wait(PHASE_TIMEOUT) in (0, 128 + signal.SIGTERM), late.output()
    assert "taken as this node's notice to leave" in late.output(), late.output()
    codes = [node.wait(PHASE_TIMEOUT) for node in (first, second)]
    outputs = "".join(node.output() for node in (first, second, late))
    assert codes == [0, 0] and "done: 150 steps" in first.output(), outputs[-12000:]
    assert "rdzv run failed" not in outputs and all(
        started_once(node) for node in (first, second)), outputs


@pytest.mark.timeout(600)
def test_sigterm_to_an_agent_and_its_workers_at_once_is_a_graceful_leave(
        launcher: Launcher, tmp_path: Path) -> None:
    log = tmp_path / "progress.jsonl"
    args = agent_args(tmp_path, serve(launcher), example(tmp_path, 300))
    a, b, c = (launcher.start(args) for _ in range(3))
    wait_for(lambda: sum(e["world_size"] == 3 for e in progress(log)) >= 20, PHASE_TIMEOUT,
             "20 steps at world size 3")
    before = len(progress(log))
    for pid in (worker_pid(c.pid), c.pid):  # as Slurm's scancel does: every process
        os.kill(pid, signal.SIGTERM)
    assert c.wait(PHASE_TIMEOUT) == 0, c.output()[-6000:]
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in (a, b)]
    outputs = "".join(node.output()[-6000:] for node in (a, b, c))
    assert codes == [0, 0], outputs
    # it left gracefully: its workers stopped at the others' switch step and exited 0 (which of
    # the worker's last word and its exit its agent heard first decides the line)
    assert "its workers stop at step" in c.output() and re.search(
        r"(its workers left at step \d+|the workers left); exiting", c.output()), c.output()
    entries = progress(log)[before:]
    assert entries[-1]["step"] == 300 and phases(entries)[-1] == 2, phases(entries)
    steps = [e["step"] for e in progress(log)]
    assert steps == list(range(steps[0], 301)), "steps redone or skipped"
    assert longest_pause(entries) < 1.0, outputs
    for node in (a, b):
        assert started_once(node) and "restarting the workers" not in node.output(), outputs


@pytest.mark.timeout(600)
def test_a_node_stopped_while_the_workers_start_restarts_them_at_once(
        launcher: Launcher, tmp_path: Path) -> None:
    """Slurm's scancel of a node (its agent and its worker) while every worker still starts in
    the group (slow here on purpose): the others' workers would wait in init_process_group for
    its worker until the connect timeout (120 s here); they restart at once in a group without
    it, and that is no failure of theirs (--max-restarts 0). The training chaos soak saw the
    others stall 23 s."""
    args = agent_args(tmp_path, serve(launcher), [WORKER, "--steps", "100", "--step-sleep",
                                                  "0.03", "--import-seconds", "8"])
    args[args.index("--max-restarts") + 1] = "0"
    args[args.index("--switch-timeout"):args.index("--switch-timeout")] = [
        "--worker-connect-timeout", "120"]
    # (the first round waits up to 5 s for the third node: a loaded machine starts agents slowly)
    args[args.index("--rdzv-conf") + 1] = "last_call_timeout=5,is_host=0"
    nodes = [launcher.start(args) for _ in range(3)]
    wait_for(lambda: all("round complete: 3 node(s)" in n.output() for n in nodes),
             PHASE_TIMEOUT, "the job of 3 nodes")
    gone = nodes.pop()
    # (its worker sleeps 8 s before it sets up: without the API's SIGTERM handler yet, it dies
    # of the signal, which its agent may hear before its own)
    for pid in (worker_pid(gone.pid), gone.pid):
        os.kill(pid, signal.SIGTERM)
    gone.wait(PHASE_TIMEOUT)
    wait_for(lambda: any("world_size 2" in n.output() for n in nodes), 60,
             "a step at world size 2 (not after the connect timeout of 120 s)")
    codes = [node.wait(PHASE_TIMEOUT) for node in nodes]
    outputs = "".join(node.output() for node in (*nodes, gone))
    assert codes == [0, 0] and "world_size 3" not in outputs, outputs[-12000:]
    assert "lost or leaving while this node's workers may still be starting" in outputs, outputs
    assert "rdzv run failed" not in outputs and "restart 1 of" not in outputs, outputs


@pytest.mark.timeout(600)
def test_a_worker_stuck_in_the_aborted_group_is_left_out_of_the_recovery(
        launcher: Launcher, tmp_path: Path) -> None:
    """Rank 1 sleeps in its step (as a worker stuck in a gloo collective that the abort does
    not wake: it neither reports the failure nor takes its plan) when the node of rank 2 is
    killed. Its agent leaves it out of the new group once its abort bound has passed; rank 0
    recovers without it then, not after the 3 s its abort watch waits before it ends it; then
    it restarts alone and joins from rank 0."""
    stall = tmp_path / "stall"
    args = agent_args(tmp_path, serve(launcher), [WORKER, "--steps", "200", "--stall-file",
                                                  str(stall), "--stall-rank", "1",
                                                  "--stall-seconds", "60"])
    nodes = [launcher.start(args) for _ in range(3)]
    wait_for(lambda: any("step 20 world_size 3" in n.output() for n in nodes), PHASE_TIMEOUT,
             "20 steps at world size 3")
    stall.touch()
    wait_for(lambda: any("rank 1 stalls" in n.output() for n in nodes), PHASE_TIMEOUT,
             "the stall")
    stall.unlink()  # one stall: the worker started in its place trains on
    first = next(n for n in nodes if "step 20 world_size 3" in n.output())
    stuck = next(n for n in nodes if "rank 1 stalls" in n.output())
    lost = next(n for n in nodes if n is not first and n is not stuck)
    os.killpg(lost.pid, signal.SIGKILL)  # rank 2's node: the others' group is aborted
    lost.wait(PHASE_TIMEOUT)
    codes = [node.wait(PHASE_TIMEOUT * 2) for node in (first, stuck)]
    outputs = first.output() + stuck.output()
    assert codes == [0, 0], outputs[-12000:]
    said = stuck.output()
    left_out = said.find("local rank(s) 0 did not leave the aborted group (")
    ended = said.find("local rank 0 ended with signal SIGKILL: restarting it alone")
    assert 0 <= left_out < ended, said[-8000:]  # left out before its watch ended it
    assert re.search(r"recovered in-process in \d+ ms[^\n]*world size 1", first.output()), (
        first.output()[-8000:])
    assert "restarting the workers" not in outputs, outputs[-12000:]
    assert "world size 2" in first.output().split("world size 1")[-1], first.output()[-6000:]
    assert "DIFFERENT" not in outputs and "done: 200 steps" in first.output(), outputs[-12000:]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("other", [
    ["--model-width", "5"],  # its model cannot load the job's state: an error in the load
    ["--model-width", "4", "--model-double"],  # it loads it, but holds another state then
], ids=["another-shape", "another-dtype"])
def test_a_newcomer_running_another_program_leaves_alone(launcher: Launcher, tmp_path: Path,
                                                         other: list[str]) -> None:
    """A node joins with another model than the job's (a stale image, a changed script): it
    cannot take the job's state. It leaves with an error that says so; the job goes on without
    it, in-process, and finishes. It used to make every node restart its workers (the
    fallback) until the newcomer ran out of restarts, whose failure closed the run: the others
    then exited 0 with the job unfinished."""
    port = serve(launcher)
    program = [WORKER, "--steps", "500", "--step-sleep", "0.03"]
    first, second = (launcher.start(agent_args(tmp_path / name, port, [
        *program, "--model-width", "4"])) for name in ("a", "b"))
    wait_for(lambda: "round complete: 2 node(s)" in first.output(), PHASE_TIMEOUT, "the job")
    newcomer = launcher.start(agent_args(tmp_path / "c", port, [*program, *other]))
    assert newcomer.wait(PHASE_TIMEOUT) == 1, newcomer.output()[-8000:]
    said = newcomer.output()
    assert "local rank 0 cannot take the job's training state (" in said, said[-8000:]
    assert "this node runs another program than the job's nodes" in said, said[-8000:]
    codes = [node.wait(PHASE_TIMEOUT) for node in (first, second)]
    outputs = first.output() + second.output()
    assert codes == [0, 0], outputs[-12000:]
    assert "recovered in-process" in outputs and "restarting" not in outputs, outputs[-12000:]
    assert started_once(first) and started_once(second), outputs[-12000:]
    assert "DIFFERENT" not in outputs and "done: 500 steps" in outputs, outputs[-12000:]
    history = subprocess.run([PYTHON, "-m", "rdzv", "status", f"tcp://127.0.0.1:{port}/job",
                              "--events"], capture_output=True, text=True, timeout=60).stdout
    assert "refused: local rank 0 cannot take the job's training state (" in history, history
