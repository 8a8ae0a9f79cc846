"""Elastic sharded training you can copy: HSDP with FSDP2 on CPU (gloo) that survives nodes
joining and leaving in-process.

Each node shards the model among its own workers (``fully_shard`` over
``rdzv.torch.node_mesh()``) and holds one replica of it; the replicas are the nodes, and under
``rdzv run`` they follow membership without a restart: a newcomer's workers each receive their
shard (parameters and optimizer state) from the worker of the same local rank on a running
node, all in parallel; a node that leaves or is lost is dropped by the others, who go on from
the most advanced whole state. ``rdzv.torch.ElasticState`` averages the gradients over the
replicas before each optimizer step. Checkpoints are sharded, with torch's DCP
(``torch.distributed.checkpoint``): the same script resumes under torchrun, after a restart, or
on another number of nodes. Run it with rdzv's agent (every node with the same
``--nproc-per-node``):

    rdzv run --nnodes 1:3 --nproc-per-node 2 --rdzv-backend tcp \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job examples/elastic_fsdp.py

or with torch's agent on rdzv's rendezvous (every change restarts the workers, which resume
from the checkpoint):

    torchrun --nnodes 1:3 --nproc-per-node 2 --rdzv-backend rdzv-tcp \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job examples/elastic_fsdp.py

``RDZV_EXAMPLE_FINISH_WITH=4:50`` in every node's environment holds the job at ``--steps`` as in
``elastic_train.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from elastic_train import (
    FEATURES,
    FinishWith,
    append_line,
    exit_now,
    make_dataset,
    parse_flags,
    pick_device,
    report_check,
    report_start,
    shard,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import rdzv.torch

HIDDEN = 256


class Net(nn.Module):
    """The trained network, with ``frozen_mb`` MB of frozen weights (a stand-in for a large
    model's state: sharded, saved and moved like the rest, but costs a step nothing)."""

    def __init__(self, frozen_mb: float) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every worker
        self.layers = nn.ModuleList([nn.Linear(FEATURES, HIDDEN), nn.Linear(HIDDEN, HIDDEN),
                                     nn.Linear(HIDDEN, 1)])
        self.frozen = nn.Linear(1, max(int(frozen_mb * 2**18), 1), bias=False)
        self.frozen.requires_grad_(False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            inputs = torch.tanh(layer(inputs))
        return self.layers[-1](inputs)


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                    step: int) -> None:
    """A collective: every worker writes its shard under ``path/step-N``; then rank 0 points
    ``path/latest`` at it (atomically) and removes the older ones."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    target = os.path.join(path, f"step-{step}")
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=target)
    if dist.get_rank() == 0:
        temporary = os.path.join(path, f"latest.tmp.{os.getpid()}")
        with open(temporary, "w") as handle:
            json.dump({"step": step, "dir": os.path.basename(target)}, handle)
        os.replace(temporary, os.path.join(path, "latest"))
        for name in os.listdir(path):
            if name.startswith("step-") and name != os.path.basename(target):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore this worker's shards from the latest checkpoint (any number of nodes wrote it);
    the step to continue from (0 without one)."""
    try:
        with open(os.path.join(path, "latest")) as handle:
            latest = json.load(handle)
    except FileNotFoundError:
        return 0
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(path, latest["dir"]))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return int(latest["step"])


def replicas_agree(model: nn.Module) -> bool:
    """Whether every node holds the same replica: each worker's fingerprint of its shards
    (per-parameter sums) is gathered, and the workers of one local rank compare theirs."""
    local = [p.to_local().detach() for p in model.parameters()]
    trained = [t for t, p in zip(local, model.parameters()) if p.requires_grad]
    mine = torch.stack([t.sum() for t in local] + [t.square().sum() for t in trained])
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    shards = int(os.environ["LOCAL_WORLD_SIZE"])
    return all(torch.equal(rows[rank], rows[rank % shards]) for rank in range(len(rows)))


def main() -> None:
    args = parse_flags(__doc__ or "", lr=0.002, checkpoint="elastic_fsdp.ckpt")  # (a directory)
    finish = FinishWith(args.steps)

    device = pick_device(args.device)
    inputs, targets = (tensor.to(device) for tensor in make_dataset())
    # Set up before ElasticState: a newcomer node's workers do it in a provisional group of
    # their own (init_process_group makes it) and join the running job in ElasticState, so
    # building, sharding and the optimizer cost the running workers nothing.
    model = Net(args.model_mb).to(device)
    rdzv.torch.init_process_group(args.backend)
    mesh = rdzv.torch.node_mesh()  # this node's workers: FSDP2 shards within, nodes are replicas
    for layer in [*model.layers, model.frozen]:  # (each gathered only when it computes)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # A newcomer's workers receive their shards and the step from a running node here; everyone
    # else (the first start, a restart, torchrun) resumes from the checkpoint.
    state = rdzv.torch.ElasticState(model=model, optimizer=optimizer)
    if not state.received:
        state.step = load_checkpoint(args.checkpoint, model, optimizer)

    @state.on_change  # after every switch; FSDP2's mesh is the node's, which does not change
    def check(state: rdzv.torch.ElasticState) -> None:
        finish.changed(state)
        report_check(args, state, replicas_agree(model), "replicas")

    check(state)
    report_start(state)

    saving = [0.0]  # seconds rank 0 spent writing checkpoints since its last progress line

    def train() -> torch.Tensor:
        """The training loop; state.run() calls it again after the group lost a member."""
        global_loss = torch.tensor(float("nan"))
        for step in state.steps(finish.total):
            if finish.before(step, state.world_size):
                break
            rank, world_size = state.rank, state.world_size
            indices = shard(step, args.batch_size, rank, world_size)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs[indices]), targets[indices])
            loss.backward()  # FSDP2 reduce-scatters within the node
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)  # every collective of the step before it is applied
            global_loss /= world_size
            optimizer.step()  # first, ElasticState averages the shards' gradients over the nodes
            done = step + 1
            if rank == 0 and (done % args.log_every == 0 or done == args.steps):
                print(f"step {done} world_size {world_size} loss {global_loss.item():.5f}", flush=True)
                append_line(args.progress, step=done, world_size=world_size, loss=global_loss.item(),
                            checkpoint_s=round(saving[0], 6))  # (since the last line)
                saving[0] = 0.0
            if done % args.save_every == 0 or done == args.steps:
                started = time.perf_counter()
                with state.outside_steps():
                    save_checkpoint(args.checkpoint, model, optimizer, done)
                saving[0] += time.perf_counter() - started
            if args.step_sleep:
                time.sleep(args.step_sleep)
        return global_loss

    global_loss = state.run(train)
    if state.left:  # this node left the job: the others train on without it
        print(f"left the job after step {state.step}", flush=True)
        exit_now()
    rdzv.torch.destroy_process_group()
    if state.rank == 0 and not global_loss.isnan():
        print(f"done: {state.step} steps, final loss {global_loss.item():.5f}", flush=True)
    exit_now()


if __name__ == "__main__":
    main()
