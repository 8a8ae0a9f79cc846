"""Real agents (``python -m rdzv.run``) and workers on loopback: env, restarts, elasticity, signals."""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest

from _agents import JOIN, WORKER, pid_alive, stop, wait_for, worker_records
from _launcher import free_port

pytestmark = pytest.mark.timeout(900)  # real processes: slow on a loaded machine


def test_two_agents_give_their_workers_torch_env(agents: Any, rdzv: Any) -> None:
    nodes = rdzv.start(agents, 2, rdzv.args("2", 2) + rdzv.worker())
    assert [node.wait() for node in nodes] == [0, 0], nodes[0].output() + nodes[1].output()
    records = worker_records(str(rdzv.out))
    assert sorted(int(r["RANK"]) for r in records) == [0, 1, 2, 3]
    for record in records:
        rank, local = int(record["RANK"]), int(record["LOCAL_RANK"])
        assert record["WORLD_SIZE"] == "4" and record["LOCAL_WORLD_SIZE"] == "2"
        assert record["GROUP_WORLD_SIZE"] == "2"
        assert rank == int(record["GROUP_RANK"]) * 2 + local
        assert record["ROLE_NAME"] == "default" and record["ROLE_RANK"] == str(rank)
        assert record["ROLE_WORLD_SIZE"] == "4"
        assert record["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert record["TORCHELASTIC_RUN_ID"] == "job"
        assert record["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert record["OMP_NUM_THREADS"] == "1"
        assert record["TORCHELASTIC_ERROR_FILE"].endswith(f"{local}/error.json")
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records}) == 1
    assert records[0]["MASTER_ADDR"] == "127.0.0.1" and int(records[0]["MASTER_PORT"]) > 0
    for node in nodes:
        text = node.output()
        assert "round complete: 2 node(s), world size 4" in text
        assert "worker rank" in text and "]:worker rank" in text  # teed with a [rank]: prefix


def test_a_crashing_worker_is_restarted_then_the_run_fails_with_a_summary(
    agents: Any, rdzv: Any
) -> None:
    args = rdzv.args("2", 2, "--max-restarts", "2") + rdzv.worker("--fail-rank", "3")
    nodes = rdzv.start(agents, 2, args)
    codes = [node.wait() for node in nodes]
    both = nodes[0].output() + nodes[1].output()
    failed = next((n for n in nodes if "rdzv run failed" in n.output()), None)
    assert failed is not None and codes[nodes.index(failed)] == 1, f"exit codes {codes}:\n{both}"
    text = failed.output()
    other = nodes[1 - nodes.index(failed)]
    # the other node: 0 only if its own workers had succeeded (as torchrun's agents); else the
    # run failed there too (its workers restarted with the failing node's cannot form their
    # group once it closed the run), not exit 0 as if the job had finished
    if "every node has finished; this node's workers succeeded" in other.output():
        assert codes[nodes.index(other)] == 0, both
    else:
        assert codes[nodes.index(other)] == 1, both
        assert "the rendezvous is closed, the run has ended on the other nodes" in \
            other.output(), both
    assert "restart 1 of 2" in text and "restart 2 of 2" in text, both
    assert "rdzv run failed: workers failed after 2 restart(s)" in text, both
    # the node serving the store (tcp: the first) lets the other leave before it goes: no
    # node waits out the store's timeout to leave
    assert "leaving failed" not in both and "cannot reach the store" not in both, both
    assert "root cause: global rank 3 (local rank 1" in text
    assert "exit code 1" in text
    assert "ValueError: rank 3 fails on purpose" in text
    assert 'in main' in text  # the worker's traceback from its error file
    log = text.split("  logs:", 1)[1].split(",")[0].strip()
    assert log.endswith("stdout.log") and os.path.isfile(log)
    with open(log) as handle:
        assert "worker rank 3 started" in handle.read()
    attempts = [r for r in worker_records(str(rdzv.out)) if r["RANK"] == "3"]
    assert sorted(r["TORCHELASTIC_RESTART_COUNT"] for r in attempts) == ["0", "1", "2"]


def test_a_third_agent_joining_mid_run_grows_the_group_to_six(agents: Any, rdzv: Any) -> None:
    args = rdzv.until_stopped("2:3", 2)
    nodes = rdzv.start(agents, 2, args)
    rdzv.running(4)
    nodes.append(agents.start(args))
    records = rdzv.running(6)
    assert sorted(int(r["RANK"]) for r in records) == list(range(6))
    assert {r["GROUP_WORLD_SIZE"] for r in records} == {"3"}
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in records} == {"0"}  # not a failure
    rdzv.stop()
    assert [node.wait() for node in nodes] == [0, 0, 0]
    text = nodes[0].output()
    # the next round formed while the workers ran; they do not use the in-process API
    assert "node(s) waiting to join: forming the next round in the background" in text, text
    assert "restarting the workers in the new round: node 0's workers do not switch " \
        "in-process" in text, text


def test_restart_on_change_takes_a_join_at_once_while_the_workers_start(
    agents: Any, rdzv: Any
) -> None:
    """Under ``--restart-on-change`` a node that joins while the others' workers are starting
    restarts them at once: the agents do not first wait for those workers to connect (here,
    up to the 300 s of ``--worker-connect-timeout``: longer than the test waits), since the
    change restarts them whatever they would report."""
    args = rdzv.args("2:3", 2, "--restart-on-change", "--worker-connect-timeout", "300")
    args += rdzv.worker("--until", rdzv.stop_file)
    nodes = rdzv.start(agents, 2, args)
    rdzv.running(4)  # (started, not connected: workers without the in-process API)
    nodes.append(agents.start(args))
    records = rdzv.running(6)
    assert {r["GROUP_WORLD_SIZE"] for r in records} == {"3"}
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in records} == {"0"}  # not a failure
    rdzv.stop()
    assert [node.wait() for node in nodes] == [0, 0, 0]
    assert "restarting the workers in the new round: node 0's workers do not switch " \
        "in-process" in nodes[0].output()


def test_sigkill_of_an_agent_makes_the_others_reform_and_carry_on(
    agents: Any, rdzv: Any
) -> None:
    nodes = rdzv.start(agents, 3, rdzv.until_stopped("2:3", 2))
    records = rdzv.running(6)
    victim = nodes[2]
    victim_rank = victim.output().split("this node is group rank ")[1].split()[0]
    victim_workers = [r["pid"] for r in records if r["GROUP_RANK"] == victim_rank]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    records = rdzv.running(4)
    assert sorted(int(r["RANK"]) for r in records) == [0, 1, 2, 3]
    wait_for(lambda: not any(pid_alive(pid) for pid in victim_workers), JOIN,
             "the killed agent's workers to die")
    rdzv.stop()
    survivors = [n for n in nodes if n is not victim]
    assert [node.wait() for node in survivors] == [0, 0]


def test_sigterm_makes_an_agent_leave_gracefully_once_the_others_reformed(
    agents: Any, rdzv: Any
) -> None:
    nodes = rdzv.start(agents, 3, rdzv.until_stopped("2:3", 2))
    rdzv.running(6)
    leaving = nodes[1]
    leaving.signal(signal.SIGTERM)
    assert leaving.wait() == 0, leaving.output()
    text = leaving.output()
    assert "SIGTERM received: leaving the job (grace 30 s)" in text, text
    assert "leaving: the other nodes formed the next round without this node; exiting" in text
    # (seconds after the start, as here, the workers may still be starting: they restart)
    assert re.search(r"1 node\(s\) leaving: forming the next round in the background|1 "
                     r"member\(s\) of the round lost or leaving", nodes[0].output())
    rdzv.running(4)
    rdzv.stop()
    assert [nodes[0].wait(), nodes[2].wait()] == [0, 0]


def test_a_second_sigterm_stops_a_leaving_agent_at_once(agents: Any, rdzv: Any) -> None:
    nodes = rdzv.start(agents, 3, rdzv.until_stopped("2:3", 1))
    rdzv.running(3)
    stuck, leaving = nodes[1], nodes[2]
    stop(stuck, rdzv)  # the others cannot form the next round: the leave lasts
    try:
        leaving.signal(signal.SIGTERM)
        wait_for(lambda: "leaving the job" in leaving.output(), 60, "the leave announcement")
        leaving.signal(signal.SIGTERM)
        assert leaving.wait() == 128 + signal.SIGTERM, leaving.output()
        assert "SIGTERM received: stopping the workers" in leaving.output()
    finally:
        stuck.signal(signal.SIGCONT)
    rdzv.stop()


def test_a_node_the_others_need_stops_at_once(agents: Any, rdzv: Any) -> None:
    nodes = rdzv.start(agents, 2, rdzv.until_stopped("2:2", 1))
    rdzv.running(2)
    nodes[1].signal(signal.SIGTERM)
    assert nodes[1].wait() == 128 + signal.SIGTERM, nodes[1].output()
    assert ("SIGTERM received: the other nodes cannot go on without this one (min nodes 2); "
            "stopping now") in nodes[1].output()
    rdzv.stop()


def test_the_node_serving_the_store_stops_at_once(agents: Any, rdzv: Any) -> None:
    if rdzv.backend != "tcp":
        pytest.skip("only the tcp backend has a node that serves the store")
    args = rdzv.until_stopped("2:3", 1)
    args[args.index("--rdzv-conf") + 1] += ",read_timeout=3"
    nodes = rdzv.start(agents, 3, args)
    rdzv.running(3)
    signalled = time.monotonic()
    nodes[0].signal(signal.SIGTERM)  # the first node serves the store the others need
    assert nodes[0].wait() == 128 + signal.SIGTERM, nodes[0].output()
    assert "this node serves the rendezvous store (is_host), which the others need" in \
        nodes[0].output()
    for node in nodes[1:]:  # the others say that the store is what they miss, and stop
        assert node.wait(60) == 1, node.output()
        assert "the rendezvous store cannot be reached any more" in node.output(), node.output()
        assert "Traceback" not in node.output()
    # within their read timeout (3 s) and their exit, not several timeouts (a loaded machine)
    assert time.monotonic() - signalled < 4 * 3, time.monotonic() - signalled


def test_a_failing_node_serving_the_store_waits_for_the_others_and_a_signal_ends_it(
        agents: Any, rdzv: Any, tmp_path: Any) -> None:
    """The run fails on the node serving the store while the other node's workers (without the
    in-process API) run on: it says that it waits for the others to leave through its store,
    and a signal ends that wait at once."""
    if rdzv.backend != "tcp":
        pytest.skip("only the tcp backend has a node that serves the store")
    trigger = tmp_path / "fail"
    args = rdzv.args("2:2", 1, "--max-restarts", "0") + rdzv.worker(
        "--until", rdzv.stop_file, "--fail-rank", "0", "--fail-when", str(trigger))
    args[args.index("--rdzv-conf") + 1] += ",read_timeout=3"  # (the other node, without it)
    nodes = rdzv.start(agents, 2, args)  # the first serves the store (rank 0)
    rdzv.running(2)
    # past the 1 s connect grace, the other node's workers are known to run without the API: it
    # waits for them after the close (within it, they might still be starting: it stops them)
    time.sleep(1.5)
    trigger.touch()
    wait_for(lambda: "waiting up to 30 s for the other nodes to see that the run ended" in
             nodes[0].output(), 60, "the host's wait")
    signalled = time.monotonic()
    nodes[0].signal(signal.SIGINT)
    assert nodes[0].wait(30) == 1, nodes[0].output()
    assert time.monotonic() - signalled < 10, nodes[0].output()  # not the wait's 30 s
    assert "rdzv run failed" in nodes[0].output(), nodes[0].output()
    rdzv.stop()  # the other node's workers end; it learns that the store went with the host
    assert nodes[1].wait(60) == 1, nodes[1].output()


def test_a_static_job_from_master_flags(agents: Any, tmp_path: Any) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = str(free_port())
    nodes = [agents.start(["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(rank),
                           "--master-addr", "127.0.0.1", "--master-port", port,
                           "--log-dir", str(tmp_path / "logs"), WORKER, str(out)])
             for rank in (0, 1)]
    assert [node.wait() for node in nodes] == [0, 0], nodes[0].output() + nodes[1].output()
    records = worker_records(str(out))
    assert sorted(int(r["RANK"]) for r in records) == [0, 1, 2, 3]
    assert {r["GROUP_RANK"] for r in records if int(r["RANK"]) >= 2} == {"1"}
    masters = {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records}
    assert len(masters) == 1 and masters.pop()[1] != port  # the workers get their own port
