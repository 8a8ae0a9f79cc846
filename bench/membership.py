"""Membership changes while training: how long rank 0's training stops, per launcher, in one table.

Run: ``.venv/bin/python bench/membership.py [--repeat 1] [--model-mb 0,200]
[--launchers rdzv,rdzv-restart,rdzv-restart-preload,torchrun-rdzv-tcp,torchrun-c10d] [--sharded] [--json out.json]``

``--sharded``: the workload is ``examples/elastic_fsdp.py`` instead (HSDP: FSDP2 over each node's
two workers, ``--nproc-per-node 2``, replicas across nodes; DCP checkpoints), and the table ends
with the rate of the shard transfer: every local rank of a node sending its shard at once, against
one stream of the same bytes (``bench/shard_transfer.py``).

The workload is ``examples/elastic_train.py`` (DDP on gloo, CPU) with one worker per node, every
node a real launcher process on 127.0.0.1 with ``--nnodes 1:3 --nproc-per-node 1``. Rank 0 appends
one JSON line per step to a progress file (``--log-every 1``: step, world size, loss, wall-clock
time after the step's all_reduce); it checkpoints every ``--save-every`` steps (default 10) and a
restarted worker resumes from the last checkpoint. ``--step-sleep`` (default 0.05 s) brings a step
to about 60 ms on a 2-core machine; the table shows the measured step.

One job per (launcher, model size, repeat), and one for the crash: nodes 1 and 2 start together (node 1 hosts the
rendezvous store, ``is_host``); after some steps at world size 2 a third node is started
(scale-out); after some steps at world size 3 the third node's launcher gets SIGTERM (graceful
scale-in). Each change is triggered half a checkpoint interval after a checkpoint (step %
save_every == save_every // 2), so a restart redoes that half interval plus the steps run while it
is under way. If the job never reached world size 3, scale-in is measured on a fresh job whose
three nodes start together. The crash is measured on a fresh job of three nodes: the third
node's launcher and all its processes are SIGKILLed mid-run (3 -> 2). For each change, from its trigger (the third launcher spawned / SIGTERM
sent) until ``--after`` steps were logged at the new world size, the bench measures the
pause (the longest gap between the times of two consecutive progress lines, counting from the
last line before the trigger, less the time rank 0 spent writing a checkpoint between them,
which every launcher pays alike), redone (lines whose step number was already seen: work lost to a
restart) and to new world (from the trigger to the first step at the new world size).

Launchers (the first is the reference of the ratio column, per change and model size):

* ``rdzv``: ``rdzv run`` (workers that use rdzv's in-process API switch without a restart);
* ``rdzv-restart``: ``rdzv run --restart-on-change`` (stop and restart the workers on every change,
  after the next round has formed in the background);
* ``rdzv-restart-preload``: the same with ``--preload torch`` (the workers are forked from a
  template that imported torch once, so a restart skips the import);
* ``torchrun-rdzv-tcp``: torchrun with rdzv's plugin; ``torchrun-c10d``: torchrun with torch's own.

Every launcher gets ``--monitor-interval 0.1 --max-restarts 3`` and ``--rdzv-conf
last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3`` (torch's c10d takes whole
seconds only: 1 s is its fastest last call); ``rdzv run`` also ``--stop-timeout 5``. Every process
the bench starts (launchers and all their descendants) is killed by pid at the end of each job,
also on an error or Ctrl-C (command lines and process handling: ``tests/_training.py``, shared
with the training chaos soak). This machine is shared: absolute times are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _training import LAUNCHERS, ROOT, JobSpec, TrainingJob, free_port  # noqa: E402  (tests/_training.py)
from shard_transfer import describe as describe_transfer  # noqa: E402  (bench/shard_transfer.py)
from shard_transfer import measure as measure_transfer  # noqa: E402

CHANGES = ("scale-out", "scale-in", "crash")
POLL = 0.01
"""Seconds between two looks at the progress file."""



class KilledFromOutside(Exception):
    """A launcher died of a SIGKILL the bench did not send (another user's cleanup on a shared
    machine): the job is run again."""


CHECK_COST = """
import json, os, sys, time
import torch
import torch.distributed as dist
sys.path.insert(0, os.path.join(os.environ["ROOT"], "examples"))
import rdzv.torch
from rdzv._channel import ChannelServer
from rdzv.torch._agreement import state_digest
from rdzv.torch._statesync import encode_tree
from elastic_train import make_model
heard = []
agent = ChannelServer(lambda local_rank, message: heard.append(message))  # a real channel
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ["PORT"], LOCAL_RANK="0", RDZV_AGENT_CHANNEL=agent.path)
dist.init_process_group("gloo", rank=0, world_size=1)
state = rdzv.torch.ElasticState(step=0)
n = 200_000
start = time.perf_counter()
for _ in range(n):
    state.step_done()
checked = time.perf_counter() - start
start = time.perf_counter()
for _ in range(n):
    pass
per_step = (checked - (time.perf_counter() - start)) / n
reports = 2_000
start = time.perf_counter()
for _ in range(reports):
    state._reported = 0.0  # every step_done reports, as one does every PROGRESS_EVERY
    state.step_done()
per_report = (time.perf_counter() - start) / reports - per_step
digests = {}
for mb in (0.0, float(os.environ["DIGEST_MB"])):
    model = make_model(mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    tree = {"step": 1, "values": {}, "model": dict(model.state_dict()),
            "optimizer": optimizer.state_dict()}
    start = time.perf_counter()
    for _ in range(5):
        state_digest(*encode_tree(tree))
    digests[mb] = (time.perf_counter() - start) / 5
from rdzv.torch._elastic import PROGRESS_EVERY
print(json.dumps({"per_step": per_step, "per_report": per_report, "every": PROGRESS_EVERY,
                  "digest": {str(mb): s for mb, s in digests.items()}}))
"""


def check_cost(digest_mb: float) -> dict[str, Any]:
    """What ElasticState costs a step (no switch due) in a real worker connected to a real
    channel, one progress report, and the agreement's digest of a state (the example's model,
    and with ``digest_mb`` MB of weights)."""
    out = subprocess.run([sys.executable, "-c", CHECK_COST], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PORT": str(free_port()), "ROOT": ROOT,
                                           "DIGEST_MB": str(digest_mb)})
    if out.returncode != 0:
        raise RuntimeError(f"measuring the per-step check failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Job(TrainingJob):
    """The launchers of one job of the bench, their logs and progress file in ``work``; which
    of them were told to stop, and why the job cannot go on."""

    def __init__(self, launcher: str, model_mb: float, work: str, args: argparse.Namespace) -> None:
        super().__init__(JobSpec(launcher, free_port(), save_every=args.save_every,
                                 step_sleep=args.step_sleep, model_mb=model_mb,
                                 sharded=args.sharded), work)
        self.args = args
        self.terminated: set[int] = set()

    def sigkill(self, node: int) -> float:
        """SIGKILL node ``node``'s launcher and every process under it at once (a lost node)."""
        self.terminated.add(node)
        return self.signal_node(node, signal.SIGKILL, whole_tree=True)

    def sigterm(self, node: int) -> float:
        self.terminated.add(node)
        return self.signal_node(node, signal.SIGTERM, whole_tree=False)

    def failure(self) -> str | None:
        """Why the job cannot go on: a launcher not told to stop has exited (its last error)."""
        for node, process in enumerate(self.nodes):
            if node not in self.terminated and process.poll() is not None:
                if process.returncode == -signal.SIGKILL:
                    raise KilledFromOutside(f"node {node + 1}'s launcher was SIGKILLed from outside")
                with open(os.path.join(self.work, f"node{node}.log"), errors="replace") as log:
                    text = log.read()
                errors = re.findall(r"\b(\w*(?:Error|Exception): \S[^\n]*)", text)
                reason = errors[-1].strip() if errors else "no error message"
                return f"node {node + 1} exited {process.returncode}: {reason[:160]}"
        return None

    def wait_steps(self, nodes: int, count: int, after: float, timeout: float,
                   phase: int | None = None) -> list[dict[str, Any]]:
        """The progress once ``count`` steps logged after ``after`` ran on ``nodes`` (and, with
        ``phase``, the last step is ``phase`` steps past a checkpoint); RuntimeError if a launcher
        fails or ``timeout`` passes first."""
        world = nodes * self.spec.nproc
        deadline = time.monotonic() + timeout
        next_track = 0.0
        while time.monotonic() < deadline:
            entries = self.entries()
            if (sum(e["world_size"] == world and e["time"] > after for e in entries) >= count
                    and (phase is None or entries[-1]["step"] % self.args.save_every == phase)):
                return entries
            if time.monotonic() >= next_track:
                self.track()
                next_track = time.monotonic() + 0.5
            reason = self.failure()
            if reason:
                raise RuntimeError(reason)
            time.sleep(POLL)
        last = self.entries()[-1:] or [{"step": None, "world_size": None, "time": time.time()}]
        raise RuntimeError(f"no {count} steps at world size {world} within {timeout:g} s (last step "
                           f"logged: {last[0]['step']} at world size {last[0]['world_size']}, "
                           f"{time.time() - last[0]['time']:.0f} s before)")


def measure(entries: list[dict[str, Any]], trigger: float, world: int, after: int) -> dict[str, Any]:
    """Pause, steps redone and time to the new world of the change triggered at ``trigger``.

    The pause leaves out the time rank 0 spent writing checkpoints between two progress lines
    (each line says it, ``checkpoint_s``): that is the cost of training with checkpoints, which
    every launcher pays alike (column "max gap before"), not of the change; a change planned
    at a checkpoint's step would otherwise count it."""
    before = [i for i, e in enumerate(entries) if e["time"] <= trigger]
    first = before[-1] if before else 0
    new = [i for i in range(first + 1, len(entries)) if entries[i]["world_size"] == world
           and entries[i]["time"] > trigger]
    window = entries[first:new[after - 1] + 1]
    seen = max((e["step"] for e in entries[:first + 1]), default=0)
    redone = 0
    for entry in window[1:]:
        redone += entry["step"] <= seen
        seen = max(seen, entry["step"])
    steady = [b["time"] - a["time"] for a, b in zip(entries[:first + 1], entries[1:first + 1])
              if a["world_size"] == b["world_size"] == entries[first]["world_size"]][-20:]
    gaps = [b["time"] - a["time"] - b.get("checkpoint_s", 0.0) for a, b in zip(window, window[1:])]
    return {"pause": max(gaps), "redone": redone,
            "to_world": entries[new[0]]["time"] - trigger,
            "step": statistics.median(steady) if steady else None,
            "steady_max": max(steady) if steady else None}


def run_job(launcher: str, model_mb: float, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Scale-out then scale-in on one job (or on a fresh 3-node job if scale-out failed)."""
    results: dict[str, dict[str, Any]] = {}
    timeout = args.phase_timeout
    jobs: list[Job] = []
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-membership-") as temporary:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
        work = tempfile.mkdtemp(prefix=f"{launcher}-{model_mb:g}MB-", dir=args.keep or temporary)
        try:
            jobs.append(Job(launcher, model_mb, work, args))
            job = jobs[0]
            try:
                job.start()
                job.start()
                job.wait_steps(2, args.warm, 0.0, timeout, args.save_every // 2)
                trigger = job.start()
                entries = job.wait_steps(3, args.after, trigger, timeout)
                results["scale-out"] = measure(entries, trigger, 3 * job.spec.nproc, args.after)
            except RuntimeError as exc:
                results["scale-out"] = {"failed": str(exc)}
                trigger = 0.0
                job.kill_all()
                os.mkdir(os.path.join(work, "fresh"))
                jobs.append(Job(launcher, model_mb, os.path.join(work, "fresh"), args))
                job = jobs[1]
                for _ in range(3):
                    job.start()
            try:
                job.wait_steps(3, args.warm, trigger, timeout, args.save_every // 2)
                trigger = job.sigterm(2)
                entries = job.wait_steps(2, args.after, trigger, timeout)
                results["scale-in"] = measure(entries, trigger, 2 * job.spec.nproc, args.after)
                job.nodes[2].wait(timeout)
                results["scale-in"]["leaver_exit"] = job.nodes[2].returncode
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                fresh = " (on a fresh 3-node job)" if len(jobs) > 1 else ""
                results.setdefault("scale-in", {})["failed"] = f"{exc}{fresh}"
            results["crash"] = crash(launcher, model_mb, work, args, jobs)
        finally:
            for job in jobs:
                job.kill_all()
    return results


def crash(launcher: str, model_mb: float, work: str, args: argparse.Namespace,
          jobs: list["Job"]) -> dict[str, Any]:
    """A fresh job of 3 nodes; the third node (launcher and workers) is SIGKILLed mid-run."""
    os.mkdir(os.path.join(work, "crash"))
    job = Job(launcher, model_mb, os.path.join(work, "crash"), args)
    jobs.append(job)
    try:
        for _ in range(3):
            job.start()
        job.wait_steps(3, args.warm, 0.0, args.phase_timeout, args.save_every // 2)
        trigger = job.sigkill(2)
        entries = job.wait_steps(2, args.after, trigger, args.phase_timeout)
        return measure(entries, trigger, 2 * job.spec.nproc, args.after)
    except RuntimeError as exc:
        return {"failed": f"{exc} (crash)"}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats that worked; the failures' messages."""
    good = [r for r in runs if "failed" not in r]
    out: dict[str, Any] = {"runs": runs, "failures": [r["failed"] for r in runs if "failed" in r]}
    for key in ("pause", "redone", "to_world", "step", "steady_max"):
        values = [r[key] for r in good if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def fmt(seconds: float | None, unit: str = "s") -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if unit == "ms" else f"{seconds:.2f} s"


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    head = ["change", "launcher", "model", "pause", "x row 1", "redone", "to new world",
            "step", "max gap before", "leaver exit"]
    lines, notes, reference = [], [], {}
    for row in rows:
        group = (row["change"], row["model_mb"])
        cell = row["result"]
        failed = cell["pause"] is None
        if cell["failures"]:
            notes.append(f"{row['launcher']}, {row['change']}, {row['model_mb']:g} MB: "
                         f"{len(cell['failures'])}/{len(cell['runs'])} failed: {cell['failures'][0]}")
        ref = reference.setdefault(group, cell["pause"])
        ratio = f"{cell['pause'] / ref:.2f}x" if ref and not failed else "-"
        lines.append([row["change"], row["launcher"], f"{row['model_mb']:g} MB",
                      f"FAILED [{len(notes)}]" if failed else fmt(cell["pause"]), ratio,
                      "-" if failed else f"{cell['redone']:g}", fmt(cell["to_world"]),
                      fmt(cell["step"], "ms"), fmt(cell["steady_max"]),
                      " ".join(str(r.get("leaver_exit", "-")) for r in cell["runs"])])
    widths = [max(len(str(x)) for x in column) for column in zip(head, *lines)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(" | ".join(str(x).ljust(w) for x, w in zip(line, widths)))
    print()
    print(f"pause: longest gap between rank 0's consecutive step completions (wall clock after the "
          f"step's all_reduce), from the last step before the trigger until {args.after} steps at "
          f"the new world size; trigger: scale-out = third launcher spawned (2 -> 3 nodes), "
          f"scale-in = SIGTERM to the third node's launcher (3 -> 2), crash = SIGKILL of the "
          f"third node's launcher and workers on a fresh 3-node job (3 -> 2). redone: steps run again "
          f"(resumed from the checkpoint, --save-every {args.save_every}). to new world: trigger "
          f"-> first step at the new world size. step: median step interval before the change "
          f"(--step-sleep {args.step_sleep}); max gap before: longest gap in the 20 steps before "
          f"(checkpoint writes, left out of the pause). leaver exit: the SIGTERMed launcher's exit code. x row 1: pause / pause of the first launcher of the same change "
          f"and model. Median of {args.repeat} run(s); "
          f"{'2 workers per node (HSDP)' if args.sharded else '1 worker per node'}, gloo on CPU, "
          f"{os.cpu_count()} CPUs shared with other work (load average at the end: "
          f"{os.getloadavg()[1]:.1f} over 5 min).")
    steps = [row["result"]["step"] for row in rows if row["result"]["step"]]
    if steps:
        step = statistics.median(steps)
        cost = args.check_cost
        per_step = cost["per_step"] + cost["per_report"] * step / cost["every"]
        print(f"per-step check (ElasticState.step_done connected to its agent, no switch due): "
              f"{cost['per_step'] * 1e6:.2f} us, plus a progress report of "
              f"{cost['per_report'] * 1e6:.1f} us every {cost['every']:g} s: "
              f"{100 * per_step / step:.4f}% of the median step ({step * 1000:.0f} ms)")
        digests = ", ".join(f"{float(mb):g} MB of frozen weights: {seconds * 1000:.1f} ms"
                            for mb, seconds in cost["digest"].items())
        print(f"the state's digest, computed by every worker entering a group (and again by "
              f"those that received the state): the example's model {digests}")
    for mb, times in args.transfers.items():
        print(describe_transfer(mb, 2, times))
    for number, note in enumerate(notes, 1):
        print(f"[{number}] {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=1, help="jobs per launcher and model size")
    parser.add_argument("--model-mb", default="0,200",
                        help="comma-separated sizes of the example's frozen weights (MB)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help=f"comma-separated subset of {', '.join(LAUNCHERS)} (first = ratio reference)")
    parser.add_argument("--sharded", action="store_true",
                        help="train examples/elastic_fsdp.py (HSDP, 2 workers per node) instead")
    parser.add_argument("--keep", metavar="DIR", help="keep each job's logs and progress in DIR")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON ('-': stdout)")
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds slept per step")
    parser.add_argument("--warm", type=int, default=20, help="steps before a change")
    parser.add_argument("--after", type=int, default=20, help="steps at the new world size that end a window")
    parser.add_argument("--phase-timeout", type=float, default=120.0,
                        help="seconds one phase (start, change) may take before it counts as failed")
    args = parser.parse_args()
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = [name for name in launchers if name not in LAUNCHERS]
    if unknown or not launchers:
        parser.error(f"--launchers: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(LAUNCHERS)}")
    try:
        sizes = [float(size) for size in args.model_mb.split(",")]
    except ValueError:
        parser.error(f"--model-mb: {args.model_mb!r} is not a comma-separated list of numbers, e.g. 0,200")
    if args.repeat < 1 or args.warm < 1 or args.after < 1:
        parser.error("--repeat, --warm and --after must be at least 1")
    args.check_cost = check_cost(max(sizes, default=200.0) or 200.0)
    args.transfers = {size: measure_transfer(size, 2, 3) for size in sizes
                      if args.sharded and size > 0}
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or kill: clean up, even if started
        signal.signal(signum, signal.default_int_handler)  # with SIGINT ignored (nohup, &)

    runs: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    outside_kills: list[str] = []
    for repeat in range(args.repeat):  # interleaved: background load hits every launcher alike
        for size in sizes:
            for launcher in launchers:
                print(f"run {repeat + 1}/{args.repeat}: {launcher}, {size:g} MB ...",
                      file=sys.stderr, flush=True)
                for attempt in range(3):
                    try:
                        results = run_job(launcher, size, args)
                        break
                    except KilledFromOutside as exc:
                        print(f"{exc}: running the job again", file=sys.stderr, flush=True)
                        outside_kills.append(f"{launcher}, {size:g} MB, run {repeat + 1}: {exc}")
                        results = {change: {"failed": f"{exc}, 3 times"} for change in CHANGES}
                for change, result in results.items():
                    runs.setdefault((change, size, launcher), []).append(result)
    rows = [{"change": change, "model_mb": size, "launcher": launcher,
             "result": summarize(runs[(change, size, launcher)])}
            for change in CHANGES for size in sizes for launcher in launchers]
    print_table(rows, args)
    for kill in outside_kills:
        print(f"job run again: {kill} (not by the bench)")
    if args.json:
        text = json.dumps({"rows": rows, "check_cost_s": args.check_cost,
                           "step_sleep": args.step_sleep, "save_every": args.save_every}, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as handle:
                handle.write(text + "\n")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: every process the bench started has been stopped")
