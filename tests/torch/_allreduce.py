"""Worker for the torch tests: joins the gloo group, all-reduces rank + 1, writes what it saw as JSON.

    python _allreduce.py OUT_DIR [--store HOST:PORT]

With ``--store`` the group bootstraps through ``rdzv.torch.init_process_group(store=...)`` on a
view (``PrefixStore``, as a round hands out) of rdzv's TCPStore server at HOST:PORT instead of
torch's TCPStore at MASTER_ADDR/MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

import rdzv.torch


def main() -> None:
    out_dir = sys.argv[1]
    store = None
    if "--store" in sys.argv:
        from rdzv.store import PrefixStore, TCPStore

        host, port = sys.argv[sys.argv.index("--store") + 1].rsplit(":", 1)
        store = PrefixStore("round-0", TCPStore(host, int(port), timeout=120))
    rank, world_size = rdzv.torch.init_process_group("gloo", store=store, timeout=120)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    record = {
        "rank": rank,
        "world_size": world_size,
        "sum": value.item(),
        "group_rank": os.environ.get("GROUP_RANK"),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
    }
    rdzv.torch.destroy_process_group()  # a barrier, then torch's (see its docstring)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    if store is not None:
        store.underlying_store.close()


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # no torch destructors at exit (see rdzv.torch.destroy_process_group)
    sys.stderr.flush()
    os._exit(0)
