"""A tiny worker for ``rdzv run``: prints its rank and the env the agent gave it, then exits.

    rdzv run --standalone --nproc-per-node 2 examples/print_rank.py

With ``--fail-rank N`` the worker of global rank N raises instead (to see restarts and the
failure summary); ``--sleep S`` keeps every worker alive S seconds first.
"""

from __future__ import annotations

import argparse
import os
import time

from rdzv.agent import record

ENV_NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
)


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    env = " ".join(f"{name}={os.environ.get(name, '')}" for name in ENV_NAMES)
    print(f"hello from rank {rank} of {os.environ['WORLD_SIZE']}: {env}", flush=True)
    time.sleep(args.sleep)
    if args.fail_rank == rank:
        raise RuntimeError(f"rank {rank} fails on purpose (--fail-rank {rank})")


if __name__ == "__main__":
    main()
