"""How fast a newcomer node receives a sharded model: every local rank at once, against one stream.

Run: ``.venv/bin/python bench/shard_transfer.py [--mb 400] [--shards 2] [--repeat 3]``

Four kinds of the same real processes on 127.0.0.1 (gloo, CPU), ``2 * shards`` of them: a
"running node" (ranks ``0..shards-1``) and a "newcomer" (ranks ``shards..2*shards-1``). The model's
``--mb`` MB are split in ``shards`` equal shards. ``parallel``: each rank of the running node sends
its shard to the newcomer's rank of the same local rank, all at once, as ``ElasticState`` does for
a model sharded over ``rdzv.torch.node_mesh()``; ``one stream``: rank 0 sends all the bytes to
rank ``shards`` (a whole replica sent by one worker, as for DDP). Both with rdzv's state transfer
(``rdzv.torch._statesync``), timed from a barrier to the last receiver's end; the median of
``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from rdzv.torch._statesync import receive_state, send_state
rank, world, mb, repeat = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                           int(sys.argv[4]))
shards = world // 2
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}",
                        rank=rank, world_size=world)
cpu = torch.device("cpu")
total = int(mb * 2**20) // 4
shard = {"weight": torch.randn(total // shards)}
whole = {"weight": torch.randn(total)}
times = {"parallel": [], "one stream": []}
for _ in range(repeat):
    for kind in times:
        dist.barrier()
        start = time.perf_counter()
        if kind == "parallel":
            if rank < shards:
                send_state(shard, [rank + shards], cpu)
            else:
                receive_state(rank - shards, cpu)
        elif rank == 0:
            send_state(whole, [shards], cpu)
        elif rank == shards:
            receive_state(0, cpu)
        done = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        times[kind].append(done.item())
if rank == 0:
    print(json.dumps(times))
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(mb: float, shards: int, repeat: int) -> dict[str, float]:
    """Median seconds of each kind of transfer of ``mb`` MB."""
    world = 2 * shards
    env = {**os.environ, "PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="rdzv-shard-transfer-") as work:
        logs = [open(os.path.join(work, f"rank{r}.log"), "w+") for r in range(world)]
        processes = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), str(mb),
                                       str(repeat)], stdout=logs[r], stderr=subprocess.STDOUT,
                                      env=env) for r in range(world)]
        try:
            codes = [p.wait(timeout=600) for p in processes]
        finally:
            for process in processes:
                process.kill()
                process.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    if any(codes):
        raise RuntimeError(f"the transfer failed: {outputs[codes.index(next(c for c in codes if c))][-2000:]}")
    times = json.loads(outputs[0].strip().splitlines()[-1])
    return {kind: statistics.median(values) for kind, values in times.items()}


def describe(mb: float, shards: int, times: dict[str, float]) -> str:
    """One line: each kind's seconds and rate, and the ratio."""
    parallel, single = times["parallel"], times["one stream"]
    return (f"shard transfer of {mb:g} MB to a newcomer node: {shards} local ranks in parallel "
            f"{parallel:.2f} s ({mb / parallel:.0f} MB/s), one stream {single:.2f} s "
            f"({mb / single:.0f} MB/s): {single / parallel:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=400.0, help="the model's size in MB")
    parser.add_argument("--shards", type=int, default=2, help="workers per node")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.mb <= 0 or args.shards < 1 or args.repeat < 1:
        parser.error("--mb must be positive, --shards and --repeat at least 1")
    print(describe(args.mb, args.shards, measure(args.mb, args.shards, args.repeat)))


if __name__ == "__main__":
    main()
