"""A worker for the agent tests: records its env as JSON, then exits as the test asks.

Usage: _worker.py OUT_DIR [--fail-rank R [--fail-when FILE]] [--until FILE] [--ignore-term]
[--sleep S]
Writes OUT_DIR/<RANK>-<pid>.json with the worker env, then runs for S seconds (default 0), or
with --until until FILE exists (at most 300 s). Rank R raises (recorded with
``rdzv.agent.record``): at once, or with --fail-when once that file exists (it takes it away).
With --ignore-term it ignores SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from rdzv.agent import record

NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
)
MAX_RUN = 300.0


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-when", default=None)
    parser.add_argument("--until", default=None)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    if args.fail_when is not None and args.fail_rank is None:
        parser.error("--fail-when needs --fail-rank")
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    env = {name: os.environ.get(name) for name in NAMES}
    env["pid"] = os.getpid()
    path = os.path.join(args.out, f"{env['RANK']}-{os.getpid()}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(env, handle)
    os.replace(path + ".tmp", path)
    print(f"worker rank {env['RANK']} started", flush=True)
    deadline = time.monotonic() + (MAX_RUN if args.until else args.sleep)
    while True:
        if fails(args, int(env["RANK"])):
            raise ValueError(f"rank {args.fail_rank} fails on purpose\nsecond line")
        left = deadline - time.monotonic()
        if left <= 0 or (args.until and os.path.exists(args.until)):
            return
        time.sleep(min(0.05, left))


def fails(args: argparse.Namespace, rank: int) -> bool:
    """Whether this rank fails now: the rank asked, at once or once the --fail-when file exists
    (taken away: the restarted worker runs on)."""
    if args.fail_rank != rank:
        return False
    if args.fail_when is None:
        return True
    try:
        os.remove(args.fail_when)
    except FileNotFoundError:
        return False
    return True


if __name__ == "__main__":
    main()
