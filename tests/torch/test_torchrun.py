"""torchrun (torch's own agent) on rdzv's backends, found through the ``torchrun.handlers`` entry points."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from _launcher import EXAMPLES, PYTHON, Launcher, free_port
from _waiting import eventually as wait_for

from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import registry as torch_registry

import rdzv.torch
from rdzv import StoreServer
from rdzv.errors import RendezvousParameterError
from rdzv.torch import TorchRendezvousHandler, TorchStore

WORKER = str(Path(__file__).with_name("_allreduce.py"))
AGENT_WORKER = str(Path(__file__).parent.parent / "agent" / "_worker.py")
RUN_TIMEOUT = 240.0
"""Seconds for a whole torchrun job of 4 workers on a loaded 2-core machine."""


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
