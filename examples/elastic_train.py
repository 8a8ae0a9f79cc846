"""Elastic training you can copy: DDP on CPU (gloo) that survives nodes joining and leaving.

Under ``rdzv run`` the training loop goes on through membership changes without restarting:
``rdzv.torch.ElasticState`` holds the model, the optimizer and the step; when a node joins or
leaves, the agents form the next round in the background and every worker switches to the new
process group at the same step, inside its process; a newcomer gets the state from a running
worker. When a node is lost, the survivors abort the failed step's collectives, re-form without
it and go on from the most advanced survivor's state, also without restarting. Each step the global batch is split by the *current* rank and world size, so the data
is sharded anew after a change. Under torchrun (or after a crash) the workers are restarted
instead and resume from the last checkpoint, which costs at most ``--save-every`` steps. Run it
with rdzv's agent:

    rdzv run --nnodes 1:3 --nproc-per-node 2 --rdzv-backend tcp \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job examples/elastic_train.py

or with torch's agent on rdzv's rendezvous:

    torchrun --nnodes 1:3 --nproc-per-node 2 --rdzv-backend rdzv-tcp \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id job examples/elastic_train.py

Start the same command on another machine (or terminal) to grow the job; stop one to shrink it.

Faults to try rdzv's health checks with, set in the environment of one node's ``rdzv run``:
``RDZV_EXAMPLE_SLOW=0.05`` adds 0.05 s of work to each of its steps (from step
``RDZV_EXAMPLE_SLOW_FROM``, 0 by default: a slow node, which rdzv flags as a straggler and, with
``--replace-stragglers``, replaces when a spare waits);
``RDZV_EXAMPLE_HANG_AT=100`` makes its workers hang at step 100 in their own code (rdzv ends
them after ``--hang-timeout`` and the others go on without them);
``RDZV_EXAMPLE_FINISH_WITH=4:50`` makes the job, at ``--steps``, train on one step at a time (up to
10 times ``--steps`` in all) until its world size is 4 and its group has not changed for 50 steps (set on
every node: a test sees a restarted worker or a spare join and train before the end, however long
its start takes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
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


def parameters_agree(model: nn.Module) -> bool:
    """Whether every rank holds the same parameters: per-parameter sums (one fast pass over the
    weights; equal weights give equal sums) compared by all_reduce."""
    sums = [p.detach().sum() for p in model.parameters()]
    squares = [p.detach().square().sum() for p in model.parameters() if p.requires_grad]
    fingerprint = torch.stack(sums + squares)
    highest, lowest = fingerprint.clone(), fingerprint.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    return bool(torch.equal(highest, lowest))


def exit_now() -> None:
    """Exit at once, DDP and its process group still held: with torch 2.13, releasing a gloo
    group that DDP held can deadlock in its destructor (see rdzv.torch.destroy_process_group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shard(step: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
    """This worker's sample indices at ``step``: the global batch split by the current ranks."""
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(step))
    return order[:batch_size][rank::world_size]  # (a CPU index tensor indexes a GPU tensor too)


def parse_flags(doc: str, lr: float, checkpoint: str) -> argparse.Namespace:
    """The flags of the examples (``elastic_fsdp.py`` takes the same)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="total training steps")
    parser.add_argument("--batch-size", type=int, default=240, help="global batch size")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--checkpoint", default=checkpoint, help="checkpoint (shared by all nodes)")
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--progress", default=None, help="also append rank 0's progress as JSON lines to this file")
    parser.add_argument("--checks", default=None,
                        help="also append rank 0's parameter check after every change of group as JSON lines "
                             "to this file (step, world size, whether all ranks agree)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to pause per step (demos)")
    parser.add_argument("--model-mb", type=float, default=0.0,
                        help="add this many MB of frozen weights to the model (benchmarks)")
    parser.add_argument("--device", default="cpu", help="where to train: cpu, or cuda (each worker "
                        "on GPU LOCAL_RANK modulo the GPUs it sees)")
    parser.add_argument("--backend", default="gloo", help="the process group's backend: gloo, or "
                        "nccl on GPUs")
    return parser.parse_args()


def pick_device(name: str) -> torch.device:
    """``name``'s device; on GPUs, this worker's (LOCAL_RANK modulo the GPUs it sees)."""
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device


def append_line(path: str | None, **fields: object) -> None:
    """One JSON line (with the time) appended to ``path`` (the progress and checks files)."""
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({**fields, "time": time.time()}) + "\n")


def report_check(args: argparse.Namespace, state: rdzv.torch.ElasticState, agree: bool,
                 what: str) -> None:
    """Rank 0 says whether every rank holds the same ``what`` after a change of group."""
    if state.rank == 0:
        print(f"world size {state.world_size} at step {state.step}: {what} "
              f"{'identical' if agree else 'DIFFERENT'} on all {'nodes' if what == 'replicas' else 'ranks'}",
              flush=True)
        append_line(args.checks, step=state.step, world_size=state.world_size, agree=agree)


def report_start(state: rdzv.torch.ElasticState) -> None:
    """Rank 0 (and a newcomer's workers) say where the training starts."""
    if state.rank == 0 or state.received:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        how = "joined a running job" if state.received else f"restart {restart}"
        print(f"starting at step {state.step} with world size {state.world_size} ({how})", flush=True)


class FinishWith:
    """Where the job ends: at ``--steps``, or with ``RDZV_EXAMPLE_FINISH_WITH=W:N`` (see above)
    once past it and the world size is W in a group that has not changed for N steps."""

    def __init__(self, steps: int) -> None:
        world, _, after = (os.environ.get("RDZV_EXAMPLE_FINISH_WITH") or "0").partition(":")
        self.steps, self.world, self.after = steps, int(world), int(after or 0)
        self.total = 10 * steps if self.world else steps
        self.entered: int | None = None  # the step at which the group began (all ranks agree)

    def changed(self, state: rdzv.torch.ElasticState) -> None:
        """A new group begins (on_change); a worker restored from its checkpoint (not agreed
        yet) counts from its first step."""
        self.entered = state.step if state.received or self.entered is not None else None

    def before(self, step: int, world_size: int) -> bool:
        """Whether the job ends before ``step`` (every rank sees this step and group)."""
        self.entered = step if self.entered is None else self.entered
        return step >= self.steps and world_size >= self.world and step - self.entered >= self.after


def main() -> None:
    args = parse_flags(__doc__ or "", lr=0.05, checkpoint="elastic_train.ckpt")
    slow = float(os.environ.get("RDZV_EXAMPLE_SLOW", "0"))
    slow_from = int(os.environ.get("RDZV_EXAMPLE_SLOW_FROM", "0"))
    hang_at = int(os.environ.get("RDZV_EXAMPLE_HANG_AT", "-1"))
    finish = FinishWith(args.steps)

    device = pick_device(args.device)
    inputs, targets = (tensor.to(device) for tensor in make_dataset())
    model = make_model(args.model_mb).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Set up before joining the group, which a newcomer to a running job does in ElasticState
    # (or, started again alone while its node's other workers run, in init_process_group): what
    # it has done before costs the running workers nothing.
    rdzv.torch.init_process_group(args.backend)
    # A newcomer to a running job receives model, optimizer and step from a running worker here;
    # everyone else (the first start, a restart, torchrun) resumes from the checkpoint.
    state = rdzv.torch.ElasticState(model=model, optimizer=optimizer)
    if not state.received:
        state.step = load_checkpoint(args.checkpoint, model, optimizer)

    ddp: DistributedDataParallel

    @state.on_change  # after every switch to a new group; called once below for the first one
    def rebuild(state: rdzv.torch.ElasticState) -> None:
        """Wrap the model for the current group. Every rank holds the same parameters here (the
        checkpoint, or the state sent by a peer), so DDP need not broadcast them; the check is
        a collective, which every rank of the group runs, newcomers included."""
        nonlocal ddp
        ddp = DistributedDataParallel(model, init_sync=False)
        finish.changed(state)
        report_check(args, state, parameters_agree(model), "parameters")

    rebuild(state)
    report_start(state)
    if state.rank == 0 or state.received:
        if state.step >= finish.total:
            print(f"the checkpoint already has {state.step} steps: nothing to do (ask for more with "
                  f"--steps {state.step + args.steps})", flush=True)
    saving = [0.0]  # seconds rank 0 spent writing checkpoints since its last progress line

    def train() -> torch.Tensor:
        """The training loop; state.run() calls it again after the group lost a member."""
        global_loss = torch.tensor(float("nan"))
        for step in state.steps(finish.total):
            if finish.before(step, state.world_size):
                break
            if step == hang_at:
                print(f"rank {state.rank} hangs at step {step} (RDZV_EXAMPLE_HANG_AT)", flush=True)
                threading.Event().wait()  # a deadlock in the program's own code
            rank, world_size = state.rank, state.world_size
            indices = shard(step, args.batch_size, rank, world_size)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(inputs[indices]), targets[indices])
            loss.backward()  # DDP averages the gradients over the current world
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)  # every collective of the step before it is applied
            global_loss /= world_size
            optimizer.step()
            done = step + 1
            if rank == 0 and (done % args.log_every == 0 or done == args.steps):
                print(f"step {done} world_size {world_size} loss {global_loss.item():.5f}", flush=True)
                append_line(args.progress, step=done, world_size=world_size, loss=global_loss.item(),
                            checkpoint_s=round(saving[0], 6))  # (since the last line)
                saving[0] = 0.0
            if rank == 0 and (done % args.save_every == 0 or done == args.steps):
                started = time.perf_counter()
                save_checkpoint(args.checkpoint, model, optimizer, done)
                saving[0] += time.perf_counter() - started
            extra = slow if step >= slow_from else 0.0
            if args.step_sleep or extra:
                time.sleep(args.step_sleep + extra)
        return global_loss

    global_loss = state.run(train)
    if state.left:  # this node left the job: the others train on without it
        print(f"left the job after step {state.step}", flush=True)
        exit_now()
    rdzv.torch.destroy_process_group()  # a barrier, then torch's (see its docstring)
    if state.rank == 0 and not global_loss.isnan():
        print(f"done: {state.step} steps, final loss {global_loss.item():.5f}", flush=True)
    exit_now()


if __name__ == "__main__":
    main()
