"""torch.distributed process groups started through rdzv: the adapter with gloo, and the env helper."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from _launcher import PYTHON, Launcher

import rdzv.torch
from rdzv.errors import RendezvousParameterError
from rdzv.server import StoreServer
from rdzv.store import HashStore

WORKER = str(Path(__file__).with_name("_allreduce.py"))
GROUP_TIMEOUT = 240.0
"""Seconds for 8 workers to import torch, form the group and all-reduce on a loaded 2-core machine."""


@pytest.fixture
def server() -> Iterator[StoreServer]:
    served = StoreServer("127.0.0.1", 0).start()
    yield served
    served.stop()


def test_gloo_group_of_eight_processes_starts_through_the_adapter(
    server: StoreServer, launcher: Launcher, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    size = 8
    workers = [
        launcher.start([PYTHON, WORKER, str(out), "--store", f"127.0.0.1:{server.port}"],
                       env={"RANK": str(rank), "WORLD_SIZE": str(size), "OMP_NUM_THREADS": "1"})
        for rank in range(size)
    ]
    codes = [worker.wait(GROUP_TIMEOUT) for worker in workers]
    assert codes == [0] * size, "\n".join(w.output()[-3000:] for w in workers if w.process.returncode)
    records = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in records) == list(range(size))
    assert {r["sum"] for r in records} == {float(sum(range(1, size + 1)))}


def test_init_without_launcher_env_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RendezvousParameterError, match="RANK is not set.*rdzv run"):
        rdzv.torch.init_process_group()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RendezvousParameterError, match="MASTER_ADDR and MASTER_PORT not set"):
        rdzv.torch.init_process_group()
    with pytest.raises(RendezvousParameterError, match="rank 3 is not in 0..1"):
        rdzv.torch.init_process_group(store=HashStore(), rank=3)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(RendezvousParameterError, match="WORLD_SIZE='two' is not an integer"):
        rdzv.torch.init_process_group()


def test_single_process_group_on_an_in_process_store() -> None:
    import torch
    import torch.distributed as dist

    rank, world_size = rdzv.torch.init_process_group(store=HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.tensor([2.0])
        dist.all_reduce(tensor)
        assert (rank, world_size, tensor.item()) == (0, 1, 2.0)
    finally:
        dist.destroy_process_group()


def test_adapter_rejects_what_is_not_an_rdzv_store() -> None:
    import torch.distributed as dist

    with pytest.raises(TypeError, match="torch's own stores need no adapter"):
        rdzv.torch.TorchStore(dist.HashStore())


def test_a_worker_imports_neither_the_agent_nor_the_rendezvous_engine() -> None:
    """What a worker's ``import rdzv.torch`` costs: torch and the in-process API, not the
    torchrun bridge (rdzv's agent and rendezvous engine), whose names load on first use."""
    code = ("import json, sys, rdzv.torch; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('rdzv.agent', "
            "'rdzv.rendezvous', 'torch.distributed.elastic'))))); "
            "print(rdzv.torch.TorchRendezvousHandler.__module__)")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, bridge = out.stdout.splitlines()
    assert json.loads(loaded) == [] and bridge == "rdzv.torch._handler"
