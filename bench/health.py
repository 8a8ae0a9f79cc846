"""Slow nodes and hung workers while training: how fast rdzv notices, what it does, what it costs.

Run: ``.venv/bin/python bench/health.py [--slow 0.05] [--healthy 0] [--json out.json]``

The workload is ``examples/elastic_train.py`` (DDP on gloo, CPU, ``--step-sleep 0.05``: a step of
about 60 ms here), one worker per node, every node a real launcher on 127.0.0.1 with a standalone
``rdzv serve``; rank 0 logs every step (``--log-every 1``). Rows:

* **straggler** (``rdzv``): two nodes (``--nnodes 1:2 --replace-stragglers``) and a third one
  waiting as a spare; from step ``SLOW_FROM`` on, node 1's steps do ``--slow`` seconds more work
  (``RDZV_EXAMPLE_SLOW``). Measured from rank 0's progress and the run's history: the time from
  the slowdown to the ``straggler_flagged`` event and to the first step with the spare in its
  place; the step rate before, during and after; steps done twice.
* **straggler** (``torchrun-rdzv-tcp``, the reference): the same two nodes under torchrun, which
  has no straggler check: the rate before and during the slowdown, over as long a run.
* **hang** (``rdzv``, ``--hang-timeout 5``): node 1's worker hangs in its own code at step
  ``HANG_AT`` (``RDZV_EXAMPLE_HANG_AT``): the longest stop of rank 0's steps (the hang's whole
  cost: the timeout, the stacks, the recovery without it). Under torchrun a hung rank holds the
  others until the process group's timeout (10 minutes by default): not run.
* **cost**: what the reporting costs a step, in a real worker connected to a real agent channel:
  ``ElasticState.step_done`` plus the step timer's hooks (one per trained parameter, one on the
  optimizer), on the example's model (4 parameters) and on one of 100 parameters.
* ``--healthy S``: three healthy nodes for S seconds: stragglers flagged and workers declared
  hung must both be 0 (no false alarm).

This machine is shared: absolute times are noisy; the side-by-side rates are what count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _training import HOST, ROOT, JobSpec, TrainingJob, free_port  # noqa: E402  (tests/_training.py)

SLOW_FROM = 300
HANG_AT = 150
HANG_TIMEOUT = 5.0
AFTER = 200
"""Steps logged with the spare in place before the straggler run ends."""
JOB_TIMEOUT = 300.0
POLL = 0.2


def serve(job: TrainingJob) -> None:
    job.spawn([sys.executable, "-m", "rdzv", "serve", "--host", HOST, "--port",
               str(job.spec.port), "--log-level", "WARNING"], "server.log")
    time.sleep(1.0)


def history(port: int, run_id: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "rdzv", "status", f"tcp://{HOST}:{port}/{run_id}",
                          "--events", "--json"], capture_output=True, text=True, timeout=60)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def wait_until(done: Callable[[], bool], job: TrainingJob, what: str) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {JOB_TIMEOUT:g} s (logs in "
                               f"{job.work})")
        time.sleep(POLL)


def rate(entries: list[dict[str, Any]]) -> float | None:
    if len(entries) < 2:
        return None
    return (entries[-1]["step"] - entries[0]["step"]) / (entries[-1]["time"] - entries[0]["time"])


def redone(entries: list[dict[str, Any]]) -> int:
    seen: set[int] = set()
    twice = 0
    for entry in entries:
        twice += entry["step"] in seen
        seen.add(entry["step"])
    return twice


def at_step(entries: list[dict[str, Any]], step: int) -> int:
    return next(i for i, e in enumerate(entries) if e["step"] >= step)


def straggler_rdzv(args: argparse.Namespace, work: str) -> dict[str, Any]:
    spec = JobSpec("rdzv", free_port(), nnodes="1:2", run_id="health", hosted=False,
                   save_every=50, flags=("--replace-stragglers",))
    job = TrainingJob(spec, work)
    try:
        serve(job)
        job.start()
        job.start({"RDZV_EXAMPLE_SLOW": str(args.slow), "RDZV_EXAMPLE_SLOW_FROM": str(SLOW_FROM)})
        wait_until(lambda: len(job.entries()) >= 20, job, "training at world size 2")
        job.start()  # the spare
        def replaced() -> bool:
            sizes = [e["world_size"] for e in job.entries()]
            if 1 not in sizes:
                return False
            return len(sizes) - sizes.index(1) > AFTER and sizes[-1] == 2
        wait_until(replaced, job, "the straggler's replacement")
        events = history(spec.port, spec.run_id)
        entries = job.entries()
    finally:
        job.kill_all()
    start = at_step(entries, SLOW_FROM)
    left = next(i for i, e in enumerate(entries) if e["world_size"] == 1)
    back = next(i for i in range(left, len(entries)) if entries[i]["world_size"] == 2)
    flagged = [e["time"] for e in events if e["kind"] == "straggler_flagged"]
    slowed = entries[start]["time"]
    return {"launcher": "rdzv", "slowed_at": slowed,
            "to_flag": flagged[0] - slowed if flagged else None,
            "to_replaced": entries[back]["time"] - slowed,
            "before": rate(entries[20:start]), "during": rate(entries[start + 1:left]),
            "after": rate(entries[back + 20:]), "redone": redone(entries),
            "flags": len(flagged), "duration": entries[-1]["time"] - entries[0]["time"]}


def straggler_torchrun(args: argparse.Namespace, work: str, duration: float) -> dict[str, Any]:
    spec = JobSpec("torchrun-rdzv-tcp", free_port(), nnodes="1:2", run_id="health",
                   hosted=False, save_every=50)
    job = TrainingJob(spec, work)
    try:
        serve(job)
        job.start()
        job.start({"RDZV_EXAMPLE_SLOW": str(args.slow), "RDZV_EXAMPLE_SLOW_FROM": str(SLOW_FROM)})
        wait_until(lambda: len(job.entries()) >= 2 and job.entries()[-1]["time"] -
                   job.entries()[0]["time"] >= duration, job, f"{duration:.0f} s of training")
        entries = job.entries()
    finally:
        job.kill_all()
    start = at_step(entries, SLOW_FROM)
    return {"launcher": "torchrun-rdzv-tcp", "to_flag": None, "to_replaced": None,
            "before": rate(entries[20:start]), "during": rate(entries[start + 1:]),
            "after": None, "redone": redone(entries), "flags": 0,
            "duration": entries[-1]["time"] - entries[0]["time"]}


def hang_rdzv(work: str) -> dict[str, Any]:
    spec = JobSpec("rdzv", free_port(), nnodes="1:2", run_id="health", hosted=False,
                   save_every=50, flags=("--hang-timeout", str(HANG_TIMEOUT)))
    job = TrainingJob(spec, work)
    try:
        serve(job)
        job.start()
        job.start({"RDZV_EXAMPLE_HANG_AT": str(HANG_AT)})
        wait_until(lambda: sum(e["world_size"] == 2 and e["step"] > HANG_AT + 20
                               for e in job.entries()) > 0, job, "the hung worker's return")
        events = history(spec.port, spec.run_id)
        entries = job.entries()
    finally:
        job.kill_all()
    at = at_step(entries, HANG_AT)
    hung = [e for e in events if e["kind"] == "worker_hung"]
    return {"launcher": "rdzv", "stop": entries[at + 1]["time"] - entries[at]["time"],
            "hangs": len(hung), "redone": redone(entries),
            "frame": hung[0]["fields"].get("frame") if hung else None}


def healthy(seconds: float, work: str) -> dict[str, Any]:
    spec = JobSpec("rdzv", free_port(), nnodes="3", run_id="health", hosted=False, save_every=50)
    job = TrainingJob(spec, work)
    try:
        serve(job)
        for _ in range(3):
            job.start()
        _wait_long(job, seconds)
        events = history(spec.port, spec.run_id)
        entries = job.entries()
    finally:
        job.kill_all()
    kinds = [e["kind"] for e in events]
    return {"seconds": entries[-1]["time"] - entries[0]["time"], "steps": len(entries),
            "rate": rate(entries), "flagged": kinds.count("straggler_flagged"),
            "hung": kinds.count("worker_hung"), "redone": redone(entries)}


def _wait_long(job: TrainingJob, seconds: float) -> None:
    deadline = time.monotonic() + seconds + JOB_TIMEOUT
    while True:
        entries = job.entries()
        if len(entries) >= 2 and entries[-1]["time"] - entries[0]["time"] >= seconds:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the healthy run did not train {seconds:g} s (logs in {job.work})")
        time.sleep(1.0)


COST = """
import json, os, statistics, sys, time
import torch
import torch.distributed as dist
from torch import nn
sys.path.insert(0, os.path.join(os.environ["ROOT"], "examples"))
import rdzv.torch
from rdzv._channel import ChannelServer
from elastic_train import make_model
agent = ChannelServer(lambda local_rank, message: None)  # a real channel
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ["PORT"], LOCAL_RANK="0", RDZV_AGENT_CHANNEL=agent.path)
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
inputs = torch.randn(120, 16)
def deep():
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(50)])
def timed(model, optimizer, state, steps=200):
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()
        if state is not None:
            state.step_done()
    return (time.perf_counter() - start) / steps
out = {}
for name, make in (("example", make_model), ("100 parameters", deep)):
    plain, elastic = make(), make()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.001)
    elastic_opt = torch.optim.SGD(elastic.parameters(), lr=0.001)
    state = rdzv.torch.ElasticState(model=elastic, optimizer=elastic_opt)
    times = {"plain": [], "elastic": []}
    for _ in range(25):  # interleaved: the machine's drift hits both alike
        times["plain"].append(timed(plain, plain_opt, None))
        times["elastic"].append(timed(elastic, elastic_opt, state))
    out[name] = {"params": sum(1 for _ in plain.parameters()),
                 **{k: statistics.median(v) for k, v in times.items()}}
print(json.dumps(out))
"""


def cost() -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", COST], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PORT": str(free_port()), "ROOT": ROOT,
                                           "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"measuring the reporting's cost failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt(value: float | None, unit: str = " s", digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow", type=float, default=0.05,
                        help="seconds of extra work per step on the slow node (default 0.05: "
                             "about half speed)")
    parser.add_argument("--healthy", type=float, default=0.0,
                        help="also run three healthy nodes this many seconds (false alarms)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-health-") as work:
        def place(name: str) -> str:
            os.makedirs(os.path.join(work, name))
            return os.path.join(work, name)
        mine = straggler_rdzv(args, place("straggler-rdzv"))
        reference = straggler_torchrun(args, place("straggler-torchrun"), mine["duration"])
        results["straggler"] = [mine, reference]
        results["hang"] = hang_rdzv(place("hang"))
        results["cost"] = cost()
        if args.healthy:
            results["healthy"] = healthy(args.healthy, place("healthy"))
    print(f"\nA slow node (+{args.slow:g} s of work per step from step {SLOW_FROM}), two nodes, "
          "a spare waiting (rdzv --replace-stragglers)")
    print(f"{'launcher':<20}{'to flag':>9}{'to replaced':>13}{'steps/s before':>16}"
          f"{'during':>8}{'after':>8}{'after/before':>14}{'redone':>8}")
    for row in results["straggler"]:
        after = row["after"] if row["after"] is not None else row["during"]
        print(f"{row['launcher']:<20}{fmt(row['to_flag']):>9}{fmt(row['to_replaced']):>13}"
              f"{fmt(row['before'], '', 2):>16}{fmt(row['during'], '', 2):>8}"
              f"{fmt(row['after'], '', 2):>8}{fmt(after / row['before'], '', 2):>14}"
              f"{row['redone']:>8}")
    mine, reference = results["straggler"]
    print(f"rate after the slowdown, rdzv / torchrun-rdzv-tcp: "
          f"{mine['after'] / reference['during']:.2f}x (torchrun stays at the slow node's pace)")
    hang = results["hang"]
    print(f"\nA worker hung in its own code at step {HANG_AT} (rdzv --hang-timeout "
          f"{HANG_TIMEOUT:g}): training stopped {hang['stop']:.2f} s; worker_hung events "
          f"{hang['hangs']} (at {hang['frame']}); steps redone {hang['redone']}. Under torchrun the "
          "others wait for the process group's timeout (10 min by default).")
    print("\nThe reporting's cost per step (median of 25 x 200 steps each way, interleaved, "
          "one thread)")
    for name, row in results["cost"].items():
        extra = row["elastic"] - row["plain"]
        print(f"  {name} ({row['params']} params): step {row['plain'] * 1e3:.3f} ms plain, "
              f"{row['elastic'] * 1e3:.3f} ms with ElasticState: +{extra * 1e6:.1f} us "
              f"({100 * extra / row['plain']:.2f}% of this step; "
              f"{100 * extra / 0.06:.3f}% of the example's 60 ms step)")
    if "healthy" in results:
        row = results["healthy"]
        print(f"\nThree healthy nodes for {row['seconds']:.0f} s ({row['steps']} steps, "
              f"{row['rate']:.1f} steps/s): stragglers flagged {row['flagged']}, workers declared "
              f"hung {row['hung']}, steps redone {row['redone']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
