"""torchrun (torch's own agent) on rdzv's backends, found through the ``torchrun.handlers`` entry points."""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager, suppress
from importlib.metadata import entry_points
from pathlib import Path
from typing import Iterator

import pytest
from _launcher import EXAMPLES, PYTHON, Launcher, LoggedProcess, free_port
from _waiting import eventually as wait_for

from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import registry as torch_registry

import rdzv.torch
from rdzv import StoreServer
from rdzv.errors import RendezvousParameterError
from rdzv.rendezvous import read_status
from rdzv.store import TCPStore
from rdzv.torch import TorchRendezvousHandler, TorchStore

WORKER = str(Path(__file__).with_name("_allreduce.py"))
AGENT_WORKER = str(Path(__file__).parent.parent / "agent" / "_worker.py")
RUN_TIMEOUT = 240.0
"""Seconds for a whole torchrun job of 4 workers on a loaded 2-core machine."""
RESUME_TIMEOUT = 60.0
"""Seconds for torchrun agents to re-form and restart their workers once the faults stop (their
workers' process group would otherwise wait out its 10-minute timeout)."""


def torchrun(backend: str, endpoint: str, out: Path, *extra: str) -> list[str]:
    return [
        PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "job",
        "--rdzv-conf", "last_call_timeout=1,heartbeat_interval=1", "--local-addr", "127.0.0.1",
        "--max-restarts", "0", "--monitor-interval", "0.2", *extra, WORKER, str(out),
    ]


@pytest.mark.parametrize("backend", ["rdzv-tcp", "rdzv-file"])
def test_two_torchrun_agents_of_two_workers_all_reduce(
    backend: str, launcher: Launcher, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}" if backend == "rdzv-tcp" else str(tmp_path / "rdzv")
    agents = [launcher.start(torchrun(backend, endpoint, out)) for _ in range(2)]
    codes = [agent.wait(RUN_TIMEOUT) for agent in agents]
    assert codes == [0, 0], "\n".join(agent.output()[-4000:] for agent in agents)
    records = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    assert {r["world_size"] for r in records} == {4}
    assert {r["sum"] for r in records} == {1.0 + 2 + 3 + 4}
    assert sorted((r["group_rank"], r["local_rank"]) for r in records) == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert len({r["master"] for r in records}) == 1
    for agent in agents:
        assert "Exception while registering out of tree plugin" not in agent.output()


def test_entry_points_name_rdzv_backends_for_torchrun() -> None:
    names = {ep.name for ep in entry_points(group="torchrun.handlers")}
    assert {"rdzv-tcp", "rdzv-file", "rdzv-etcd"} <= names
    assert set(rdzv.torch.register_torch_backends()) == {"rdzv-tcp", "rdzv-file", "rdzv-etcd"}


def test_torch_registry_creates_a_bridge_whose_round_store_is_a_torch_store(tmp_path: Path) -> None:
    params = torch_api.RendezvousParameters(
        "rdzv-file", str(tmp_path), "solo", 1, 1, local_addr="127.0.0.1",
        timeout=900, last_call_timeout=0,
    )
    handler = torch_registry.get_rendezvous_handler(params)
    assert isinstance(handler, TorchRendezvousHandler)
    assert handler.get_backend() == "rdzv-file" and handler.get_run_id() == "solo"
    assert handler.use_agent_store is False
    try:
        info = handler.next_rendezvous()
        assert isinstance(info, torch_api.RendezvousInfo)
        assert (info.rank, info.world_size) == (0, 1)
        assert isinstance(info.store, TorchStore)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert info.bootstrap_store_info.master_port > 0
        info.store.set("k", b"\x00v")
        assert info.store.multi_get(["k"]) == [b"\x00v"]
        assert handler.num_nodes_waiting() == 0 and not handler.is_closed()
        handler.set_closed()
        assert handler.is_closed()
        with pytest.raises(torch_api.RendezvousClosedError):
            handler.next_rendezvous()
    finally:
        assert handler.shutdown()


def test_bad_options_and_backends_say_what_to_fix(tmp_path: Path) -> None:
    params = torch_api.RendezvousParameters("rdzv-file", str(tmp_path), "job", 1, 2, join_timout=5)
    with pytest.raises(RendezvousParameterError, match="Did you mean 'join_timeout'"):
        rdzv.torch.create_torch_handler(params)
    with pytest.raises(RendezvousParameterError, match="rdzv-tcp, rdzv-file, rdzv-etcd"):
        rdzv.torch.create_torch_handler(torch_api.RendezvousParameters("c10d", "x:1", "job", 1, 1))


def test_timeouts_map_to_torch_errors(tmp_path: Path) -> None:
    params = torch_api.RendezvousParameters(
        "rdzv-file", str(tmp_path), "lonely", 2, 2, join_timeout=0.5, last_call_timeout=0
    )
    handler = rdzv.torch.create_torch_handler(params)
    try:
        with pytest.raises(torch_api.RendezvousTimeoutError, match="join_timeout"):
            handler.next_rendezvous()
    finally:
        handler.shutdown()


def test_example_trains_under_torchrun_and_resumes_from_its_checkpoint(
    launcher: Launcher, tmp_path: Path
) -> None:
    example = str(EXAMPLES / "elastic_train.py")
    checkpoint = str(tmp_path / "model.ckpt")

    def run(steps: int) -> str:
        agent = launcher.start([
            PYTHON, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--rdzv-backend", "rdzv-tcp", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-id", "train", "--local-addr", "127.0.0.1", "--max-restarts", "0",
            example, "--steps", str(steps), "--checkpoint", checkpoint, "--log-every", "10",
        ])
        assert agent.wait(RUN_TIMEOUT) == 0, agent.output()[-4000:]
        return agent.output()

    first = run(20)
    assert "starting at step 0 with world size 2" in first and "done: 20 steps" in first
    second = run(40)
    assert "starting at step 20 with world size 2" in second and "done: 40 steps" in second
    assert "step 30 world_size 2 loss" in second


def test_torchrun_with_a_spare_agent_runs_its_job_once(launcher: Launcher, tmp_path: Path) -> None:
    """Three torchrun agents for at most two nodes: the third waits as a spare (torch's c10d
    keeps such nodes in a redundancy list); the group of two is not re-formed for it."""
    out = tmp_path / "out"
    out.mkdir()
    with StoreServer("127.0.0.1", 0) as server:  # outlives the agents, whichever ends first
        argv = [PYTHON, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node",
                "1", "--rdzv-backend", "rdzv-tcp", "--rdzv-endpoint", f"127.0.0.1:{server.port}",
                "--rdzv-id", "job", "--rdzv-conf", "last_call_timeout=1,heartbeat_interval=1",
                "--local-addr", "127.0.0.1", "--max-restarts", "0", "--monitor-interval", "0.2",
                AGENT_WORKER, str(out), "--sleep", "8"]
        agents = [launcher.start(argv) for _ in range(3)]

        def group_of_two() -> list[dict[str, str]] | None:
            records = [json.loads(path.read_text()) for path in out.glob("*.json")]
            pair = [r for r in records if r["WORLD_SIZE"] == "2"]
            return pair if len(pair) == 2 else None

        wait_for(group_of_two, RUN_TIMEOUT, "a group of two workers")
        members = [a for a in agents if "worker rank" in a.output()]
        assert len(members) == 2, [a.output()[-2000:] for a in agents]
        assert [member.wait(RUN_TIMEOUT) for member in members] == [0, 0]
        # The running pair was never re-formed for the spare: one group, started once.
        records = [json.loads(path.read_text()) for path in out.glob("*.json")]
        assert len([r for r in records if r["WORLD_SIZE"] == "2"]) == 2, records


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (none once it is gone)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def worker_pid(agent_pid: int) -> int | None:
    """The worker an agent of ``--nproc-per-node 1`` has started, if any yet."""
    return next(iter(children(agent_pid)), None)


@contextmanager
def killing_workers(agents: list[LoggedProcess]) -> Iterator[None]:
    """At the end, SIGKILL the torchrun ``agents`` (also those started meanwhile) and their
    workers, which torch starts in sessions of their own (the launcher's kill of an agent's
    process group misses them). Each agent is stopped first, so it starts no worker meanwhile."""
    try:
        yield
    finally:
        for agent in agents:
            if agent.process.poll() is None:
                os.kill(agent.pid, signal.SIGSTOP)
                for pid in children(agent.pid):
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            agent.kill()


def example_job(server: StoreServer, tmp_path: Path, conf: str) -> tuple[list[str], Path]:
    """A torchrun node of ``examples/elastic_train.py`` in a job of 2 nodes on ``server``, one
    worker each, rank 0 logging every step to the progress file (also returned)."""
    progress = tmp_path / "progress.jsonl"
    return [PYTHON, "-m", "torch.distributed.run", "--nnodes", "2:2", "--nproc-per-node", "1",
            "--rdzv-backend", "rdzv-tcp", "--rdzv-endpoint", f"127.0.0.1:{server.port}",
            "--rdzv-id", "job", "--rdzv-conf", conf, "--local-addr", "127.0.0.1",
            "--max-restarts", "100", "--monitor-interval", "0.1",
            str(EXAMPLES / "elastic_train.py"), "--steps", "1000000",
            "--checkpoint", str(tmp_path / "model.ckpt"), "--log-every", "1",
            "--progress", str(progress), "--step-sleep", "0.05"], progress


def step_lines(progress: Path) -> list[str]:
    """Rank 0's complete step lines so far (the last one may be half written)."""
    return progress.read_text().split("\n")[:-1] if progress.exists() else []


def steps_at(progress: Path, world_size: int, after: int = 0) -> int:
    """How many of rank 0's step lines past the first ``after`` ran at ``world_size``."""
    return sum(json.loads(line)["world_size"] == world_size
               for line in step_lines(progress)[after:])


def assert_training_resumes(progress: Path, after: int, agents: list[LoggedProcess]) -> None:
    """Wait until 5 steps past the first ``after`` ran at world size 2, or an agent exited;
    AssertionError with the agents' output if neither happens within RESUME_TIMEOUT."""
    try:
        wait_for(lambda: steps_at(progress, 2, after) >= 5
                 or any(agent.process.poll() is not None for agent in agents),
                 RESUME_TIMEOUT, f"training at world size 2 within {RESUME_TIMEOUT:g} s")
    except AssertionError as exc:
        raise AssertionError("\n".join([str(exc)] + [agent.output()[-3000:] for agent in agents]))
    for agent in agents:
        assert agent.process.poll() is None, agent.output()[-3000:]


@pytest.mark.timeout(300)
def test_torchrun_re_forms_when_a_member_is_lost_before_its_workers_connect(
    launcher: Launcher, tmp_path: Path
) -> None:
    """Issue 22: a full round (max_nodes members) loses a member after the seal, before that
    member's worker has joined the workers' process group. The survivor's worker waits in
    ``init_process_group`` for it (10 minutes), and torch's agent re-forms only when
    ``num_nodes_waiting()`` is positive: it must count the lost member, and the replacement
    node waiting for the round's free place, or training never resumes."""
    with StoreServer("127.0.0.1", 0) as server:  # the standalone store of the runs
        argv, progress = example_job(server, tmp_path, "last_call_timeout=1,heartbeat_interval=1")
        with killing_workers(launcher.started):
            survivor, lost = launcher.start(argv), launcher.start(argv)
            # The round of two is sealed; the lost node's worker is held before it connects ...
            worker = wait_for(lambda: worker_pid(lost.pid), RUN_TIMEOUT,
                              "the second node's worker")
            os.kill(worker, signal.SIGSTOP)
            wait_for(lambda: worker_pid(survivor.pid), RUN_TIMEOUT, "the first node's worker")
            # ... and the node dies (agent and worker); a replacement node starts.
            os.kill(worker, signal.SIGKILL)
            lost.kill()
            assert not progress.exists(), "the workers trained without the lost node's worker"
            replacement = launcher.start(argv)
            assert_training_resumes(progress, 0, [survivor, replacement])


@pytest.mark.timeout(300)
def test_a_torchrun_node_paused_past_its_session_ttl_joins_again(
    launcher: Launcher, tmp_path: Path
) -> None:
    """A node (agent and worker) stopped longer than its session ttl: the other node takes it
    for lost and re-forms; the stopped agent, resumed, learns that its session expired from
    ``num_nodes_waiting()``. It must not exit on that error but re-form as a new node, so that
    the job trains at its size again."""
    with StoreServer("127.0.0.1", 0) as server:
        argv, progress = example_job(
            server, tmp_path, "last_call_timeout=1,heartbeat_interval=0.5,heartbeat_misses=2")
        with killing_workers(launcher.started):
            first, paused = launcher.start(argv), launcher.start(argv)
            wait_for(lambda: steps_at(progress, 2) >= 3, RUN_TIMEOUT, "3 steps at world size 2")
            stopped = [paused.pid] + children(paused.pid)  # the whole node: agent and worker
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            # past its session ttl (0.5 s x 2): the run's status shows it not alive
            with TCPStore("127.0.0.1", server.port, timeout=30) as observer:
                wait_for(lambda: any(not m.alive for m in read_status(observer, "job").members),
                         RESUME_TIMEOUT, "the status to show the paused node not alive")
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            assert_training_resumes(progress, len(step_lines(progress)), [first, paused])
