"""Worker for the torch tests: joins the gloo group, all-reduces rank + 1, writes what it saw as JSON.

    python _allreduce.py OUT_DIR [--through-store]

With ``--through-store`` the group bootstraps through ``rdzv.torch.init_process_group(store=...)``
on the FileStore at env RDZV_TEST_STORE_DIR instead of MASTER_ADDR/MASTER_PORT.
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
    if "--through-store" in sys.argv:
        from rdzv.store import FileStore

        store = FileStore(os.path.join(os.environ["RDZV_TEST_STORE_DIR"], "store"), timeout=120)
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
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    if store is not None:
        store.close()


if __name__ == "__main__":
    main()
