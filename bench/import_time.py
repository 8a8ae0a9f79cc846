"""Import cost: ``import rdzv`` against ``import torch.distributed.elastic.rendezvous``.

Run: ``.venv/bin/python bench/import_time.py [--runs 7]``. Each import runs in a fresh
interpreter; the table shows the median wall time of the import alone (interpreter start-up
excluded) and, when torch is installed, the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PROBE = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def import_seconds(module: str, runs: int) -> float:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    times = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", PROBE.format(module=module)],
            env=env, capture_output=True, text=True, check=True, timeout=120,
        )
        times.append(float(out.stdout))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    rows = [("rdzv", import_seconds("rdzv", args.runs))]
    if importlib.util.find_spec("torch") is not None:
        rows.append(("torch.distributed.elastic.rendezvous",
                     import_seconds("torch.distributed.elastic.rendezvous", args.runs)))
    print(f"{'module':<40} {'median import':>14}")
    for name, seconds in rows:
        print(f"{name:<40} {seconds * 1000:>11.1f} ms")
    if len(rows) == 2:
        print(f"torch / rdzv: {rows[1][1] / rows[0][1]:.1f}x (target: rdzv under 100 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
