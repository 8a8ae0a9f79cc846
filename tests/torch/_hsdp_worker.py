"""A small sharded training loop (FSDP2 over ``rdzv.torch.node_mesh()``, one replica per node)
for the tests of a node's workers leaving a step at different points.

``--slow-file F --slow-seconds T``: once F exists, local rank 0 of every node sleeps T s at
the end of each step, after the optimizer's step (data loading, say), and says so first; its
node's other workers meanwhile wait for it in the next step's first all-gather (FSDP2's, over
the node's group). ``--setup-seconds T``: a slow set-up, T s between ``init_process_group`` and
``ElasticState`` (sharding a large model, loading data). After every change of group, and at the
end, global rank 0 prints whether the replicas agree.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import rdzv.torch
from _program import finish, run


def replicas_agree(model: nn.Module) -> bool:
    """Whether the workers of each local rank hold the same shard (a collective)."""
    mine = torch.stack([p.to_local().detach().sum() for p in model.parameters()])
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    shards = int(os.environ["LOCAL_WORLD_SIZE"])
    return all(torch.equal(rows[rank], rows[rank % shards]) for rank in range(len(rows)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--slow-file", default=None)
    parser.add_argument("--slow-seconds", type=float, default=1.0)
    parser.add_argument("--setup-seconds", type=float, default=0.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    rdzv.torch.init_process_group("gloo")
    mesh = rdzv.torch.node_mesh()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.setup_seconds:
        print(f"pid {os.getpid()} sets up for {args.setup_seconds} s", flush=True)
        time.sleep(args.setup_seconds)
    state = rdzv.torch.ElasticState(model=model, optimizer=optimizer)
    local_rank = int(os.environ["LOCAL_RANK"])

    @state.on_change
    def check(state: rdzv.torch.ElasticState) -> None:
        agree = replicas_agree(model)
        if state.rank == 0:
            print(f"world size {state.world_size} at step {state.step}: replicas "
                  f"{'identical' if agree else 'DIFFERENT'}", flush=True)

    check(state)

    def train() -> None:
        for step in state.steps(args.steps):
            generator = torch.Generator().manual_seed(step)
            inputs = torch.randn(16, 8, generator=generator)
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            optimizer.step()  # ElasticState first averages the shards' gradients over the nodes
            if state.rank == 0:
                print(f"step {step + 1} world_size {state.world_size} pid {os.getpid()}",
                      flush=True)
            pause = args.step_sleep  # the step's own work
            if local_rank == 0 and args.slow_file and os.path.exists(args.slow_file):
                print(f"rank {state.rank} sleeps {args.slow_seconds} s after step {step + 1}",
                      flush=True)
                pause += args.slow_seconds
            time.sleep(pause)

    finish(state, train, check)


if __name__ == "__main__":
    run(main)
