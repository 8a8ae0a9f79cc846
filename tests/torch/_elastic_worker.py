"""A small training loop on rdzv.torch.ElasticState for the in-process tests.

Each step all_reduces a counter (so the ranks move in lock step, as DDP does) and sleeps a
little. ``--stall-file F --stall-rank R``: once F exists, global rank R sleeps ``--stall-seconds``
in its next step (a worker that does not reach the switch step in time). ``--perturb-file F
--perturb-rank R``: once F exists, global rank R adds 1 to its weights, once (a worker whose
state differs from the others', as a protocol error would leave it). ``--stale-rank R``: at
the first start, every rank but R restores step 10 and weights of 10 (a newer checkpoint than
R's). ``--outside-at S --outside-seconds T``: at step S every rank spends T s outside the steps
(``state.outside_steps()``, an evaluation). ``--import-seconds T``: a worker started with its
group waits T s before it, as a slow import (a loaded machine, a shared file system) would;
``--join-seconds T``: likewise a worker started to join a running group. ``--finish-with W``:
at ``--steps``, train on (up to ten times as many) until the world size is W (a test sees a
newcomer join before the end, however long its start takes on a loaded machine).
``--model-width W``: the state also holds a ``Linear(W, 1)`` model (a node started with
another width runs another program; ``--model-double``: in float64, which loads a float32
state without an error, but holds another). After every
change of group, and at the end, rank 0 prints whether every rank holds the same weights.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import rdzv.torch
from _program import finish, run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--stall-file", default=None)
    parser.add_argument("--stall-rank", type=int, default=1)
    parser.add_argument("--stall-seconds", type=float, default=20.0)
    parser.add_argument("--perturb-file", default=None)
    parser.add_argument("--perturb-rank", type=int, default=1)
    parser.add_argument("--stale-rank", type=int, default=None)
    parser.add_argument("--outside-at", type=int, default=-1)
    parser.add_argument("--outside-seconds", type=float, default=0.0)
    parser.add_argument("--import-seconds", type=float, default=0.0)
    parser.add_argument("--join-seconds", type=float, default=0.0)
    parser.add_argument("--finish-with", type=int, default=0)
    parser.add_argument("--model-width", type=int, default=0)
    parser.add_argument("--model-double", action="store_true")
    args = parser.parse_args()
    time.sleep(args.join_seconds if os.environ.get("RDZV_INPROCESS_JOIN") else
               args.import_seconds)
    weight = torch.zeros(4)
    rdzv.torch.init_process_group("gloo")
    model = torch.nn.Linear(args.model_width, 1) if args.model_width else None
    if model is not None and args.model_double:
        model = model.double()
    state = rdzv.torch.ElasticState(model=model, step=0, weight=weight)
    stalled = perturbed = False

    @state.on_change
    def check(state: rdzv.torch.ElasticState) -> None:
        highest, lowest = state.values["weight"].clone(), state.values["weight"].clone()
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        if state.rank == 0:
            same = "identical" if torch.equal(highest, lowest) else "DIFFERENT"
            print(f"world size {state.world_size} at step {state.step}: weights {same}",
                  flush=True)

    if args.stale_rank is not None and not state.received and state.rank != args.stale_rank:
        state.step = 10  # what a newer checkpoint than the stale rank's would restore
        state.values["weight"] += 10
    check(state)  # as the callbacks run after a change, on every worker (newcomers too)

    def train() -> None:
        nonlocal stalled, perturbed
        steps = 10 * args.steps if args.finish_with else args.steps
        for step in state.steps(steps):
            if step >= args.steps and state.world_size >= args.finish_with:
                break  # (every rank sees this step and group)
            if (args.perturb_file and not perturbed and state.rank == args.perturb_rank
                    and os.path.exists(args.perturb_file)):
                perturbed = True
                state.values["weight"] += 1
                print(f"rank {state.rank} perturbs its weights at step {step}", flush=True)
            total = torch.ones(1)
            dist.all_reduce(total)
            if state.rank == 0:
                print(f"step {step + 1} world_size {state.world_size} sum {int(total.item())} "
                      f"pid {os.getpid()}", flush=True)
            pause = args.step_sleep  # the step's own work
            if (args.stall_file and not stalled and state.rank == args.stall_rank
                    and os.path.exists(args.stall_file)):
                stalled = True
                print(f"rank {state.rank} stalls for {args.stall_seconds} s", flush=True)
                pause += args.stall_seconds
            time.sleep(pause)
            if step + 1 == args.outside_at:
                with state.outside_steps():
                    time.sleep(args.outside_seconds)

    finish(state, train, check)


if __name__ == "__main__":
    run(main)
