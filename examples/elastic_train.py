"""Elastic training you can copy: DDP on CPU (gloo) that survives nodes joining and leaving.

Every worker resumes from the last checkpoint, so a membership change (the agent restarts all
workers with the new world size) or a crash costs at most ``--save-every`` steps. Each step the
global batch is split by the *current* rank and world size, so the data is sharded anew after a
change. Run it with rdzv's agent:

    rdzv run --nnodes 1:3 --nproc-per-node 2 --rdzv-backend tcp \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job examples/elastic_train.py

or with torch's agent on rdzv's rendezvous:

    torchrun --nnodes 1:3 --nproc-per-node 2 --rdzv-backend rdzv-tcp \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job examples/elastic_train.py

Start the same command on another machine (or terminal) to grow the job; stop one to shrink it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import rdzv.torch

FEATURES = 16
SAMPLES = 4096


def make_dataset(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression task (the same on every worker): y = Xw + sin(2Xw) / 2 + noise."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    projection = inputs @ (torch.randn(FEATURES, 1, generator=generator) / FEATURES**0.5)
    noise = 0.05 * torch.randn(SAMPLES, 1, generator=generator)
    targets = projection + 0.5 * torch.sin(2 * projection) + noise
    return inputs, targets


def make_model(frozen_mb: float = 0.0) -> nn.Module:
    """The trained network; ``frozen_mb`` MB of frozen weights come with it (a stand-in for a
    large model's state: it is saved, loaded and moved like the rest, but costs a step nothing)."""
    torch.manual_seed(0)  # the same initial weights on every worker
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 1))
    if frozen_mb > 0:
        model.frozen = nn.Parameter(torch.randn(int(frozen_mb * 2**18)), requires_grad=False)
    return model


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Write the checkpoint atomically: a reader sees the old file or the new one, never half."""
    temporary = f"{path}.tmp.{os.getpid()}"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    with open(temporary, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model and optimizer from ``path``; the step to continue from (0 without one)."""
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def shard(step: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
    """This worker's sample indices at ``step``: the global batch split by the current ranks."""
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(step))
    return order[:batch_size][rank::world_size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="total training steps")
    parser.add_argument("--batch-size", type=int, default=240, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default="elastic_train.ckpt", help="checkpoint file (shared by all nodes)")
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--progress", default=None, help="also append rank 0's progress as JSON lines to this file")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to pause per step (demos)")
    parser.add_argument("--model-mb", type=float, default=0.0,
                        help="add this many MB of frozen weights to the model (benchmarks)")
    args = parser.parse_args()

    rank, world_size = rdzv.torch.init_process_group("gloo")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    inputs, targets = make_dataset()
    model = make_model(args.model_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = load_checkpoint(args.checkpoint, model, optimizer)
    ddp = DistributedDataParallel(model)
    if rank == 0:
        print(f"starting at step {step} with world size {world_size} (restart {restart})", flush=True)
        if step >= args.steps:
            print(f"the checkpoint already has {step} steps: nothing to do (ask for more with "
                  f"--steps {step + args.steps})", flush=True)
    global_loss = torch.tensor(float("nan"))

    while step < args.steps:
        indices = shard(step, args.batch_size, rank, world_size)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(inputs[indices]), targets[indices])
        loss.backward()  # DDP averages the gradients over the current world
        optimizer.step()
        step += 1
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world_size
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step} world_size {world_size} loss {global_loss.item():.5f}", flush=True)
            if args.progress:
                with open(args.progress, "a") as handle:
                    handle.write(json.dumps({"step": step, "world_size": world_size,
                                             "loss": global_loss.item(), "time": time.time()}) + "\n")
        if rank == 0 and (step % args.save_every == 0 or step == args.steps):
            save_checkpoint(args.checkpoint, model, optimizer, step)
        if args.step_sleep:
            time.sleep(args.step_sleep)

    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and not global_loss.isnan():
        print(f"done: {step} steps, final loss {global_loss.item():.5f}", flush=True)


if __name__ == "__main__":
    main()
