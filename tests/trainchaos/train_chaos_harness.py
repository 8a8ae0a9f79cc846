"""The training chaos soak (issue 22): a real ``rdzv serve``, real agents running
``examples/elastic_train.py``, seeded faults of every kind, and the invariants checked from rank
0's progress and parameter checks (train_chaos_checks), per launcher, in one table.

``python tests/trainchaos/train_chaos_harness.py --duration 120 --seed 22 --every 8
[--kinds join,leave,...] [--launchers rdzv,rdzv-restart,torchrun-rdzv-tcp] [--sharded]
[--workdir DIR] [--json OUT]`` (``scripts/train-chaos`` runs it with the project's venv).
``--sharded``: the job is ``examples/elastic_fsdp.py`` (HSDP) with two workers per node. Exits 1
on a violation of a hard invariant; prints which of issue 22's targets each launcher met.

Each launcher gets a fresh ``rdzv serve`` (tcp backend, a free port on 127.0.0.1), checkpoint
and work directory (``<workdir>/<launcher>/``: ``server.log``, ``node<i>.log``, the progress
and checks files, ``faults.log``, ``summary.json``), and the same schedule (train_chaos_schedule):

1. nodes 0, 1, 2 start (``--nnodes 2:4 --nproc-per-node 1``, one worker each, the example with
   ``--step-sleep 0.05 --log-every 1 --progress --checks``, ``--max-restarts 1000``);
2. once WARM_STEPS steps ran at world size 3, the measured window of ``--duration`` seconds
   starts and the faults come as scheduled, every ``--every`` seconds about; they stop
   ``Limits.recovery`` + the longest SIGSTOP before the window ends, so that the recovery after
   the last one is inside the window;
3. at the window's end, the processes of the nodes whose agent has ended must be gone (orphans
   are leftovers); then the cleanup: SIGCONT to any stopped node, SIGTERM to every agent (to rdzv's
   again AGAIN s later: stop now) and, once they ended (at most CLEANUP_WAIT s, then SIGKILL),
   to the server; any process of the run still alive 1 s later is a leftover (found by /proc:
   the pids started, their descendants seen during the run, and every process carrying the
   run's marker in its environment). Then every process of the run is SIGKILLed by pid, also
   on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # _training, when run as a script

from _training import HOST, JobSpec, TrainingJob, free_port, read_jsonl, send  # noqa: E402
from _waiting import eventually  # noqa: E402
from train_chaos_checks import (Analysis, Limits, Observed, analyse,  # noqa: E402
                                count_restarts, parse_checks, parse_steps, ratio_of, seconds,
                                summary, targets)
from train_chaos_schedule import (KINDS, MAX_NODES, MIN_NODES, REMOVALS,  # noqa: E402
                                  STOP_LENGTH, Fault, plan)

logger = logging.getLogger(__name__)

LAUNCHERS = ("rdzv", "rdzv-restart", "torchrun-rdzv-tcp")
"""The default launchers: ``rdzv`` (in-process changes), ``rdzv-restart`` (``rdzv run
--restart-on-change``), ``torchrun-rdzv-tcp`` (torchrun with rdzv's rendezvous plugin)."""
CHOICES = (*LAUNCHERS, "rdzv-restart-preload")
"""What ``--launchers`` may name: also ``rdzv-restart-preload`` (restarts, the workers forked from
a template that has imported torch: ``--preload torch``)."""
IN_PROCESS = ("rdzv",)
"""Launchers whose workers go on through changes: for them a planned change redoes no step and
a loss at most one (the others restart from the checkpoint, up to --save-every steps back)."""
MAX_RESTARTS = 1000
WARM_STEPS = 20
START_TIMEOUT = 120.0
"""Seconds the first three nodes may take to train WARM_STEPS steps together."""
SERVER_TIMEOUT = 15.0
CLEANUP_WAIT = 30.0
"""Seconds the agents get to end after the cleanup's SIGTERM."""
AGAIN = 2.0
"""Seconds after which the cleanup sends rdzv's agents a second SIGTERM, which stops a node at
once (the first starts a graceful leave, whose grace every node waits out when all leave)."""
WORKER_WAIT = 2.0
"""Seconds a worker-crash waits for the node to have a worker to kill (it may be restarting)."""
TICK = 0.05
TRACK_EVERY = 0.5


@dataclass(frozen=True)
class Config:
    duration: float = 120.0
    seed: int = 22
    every: float = 8.0
    kinds: tuple[str, ...] = KINDS
    limits: Limits = Limits()
    sharded: bool = False
    """``examples/elastic_fsdp.py`` with two workers per node, not ``elastic_train.py``."""

    @property
    def until(self) -> float:
        """Faults come in the first ``until`` seconds of the window."""
        return self.duration - self.limits.recovery - STOP_LENGTH[1]

    def schedule(self) -> list[Fault]:
        return plan(self.seed, self.until, self.every, self.kinds)


class Soak:
    """One launcher's run in ``work``; :meth:`close` stops every process it started."""

    def __init__(self, launcher: str, config: Config, work: Path) -> None:
        self.launcher, self.config, self.work = launcher, config, work
        spec = JobSpec(launcher, free_port(), nnodes=f"{MIN_NODES}:{MAX_NODES}",
                       run_id="trainchaos", max_restarts=MAX_RESTARTS, hosted=False, checks=True,
                       sharded=config.sharded)
        torchrun_log = {"LOGLEVEL": "INFO"} if launcher.startswith("torchrun") else {}
        self.job = TrainingJob(spec, str(work), torchrun_log)  # LOGLEVEL: torchrun's restarts
        self.injected: list[Fault] = []
        self.stopped: dict[int, tuple[float, list[int]]] = {}
        """Stopped nodes: when to resume them (monotonic) and the pids stopped."""
        self.removed: set[int] = set()
        """Nodes a fault removed: their agents are expected to end."""
        self.reported: set[int] = set()
        self.notes: list[str] = []
        self.leftovers: list[str] = []
        self.orphans: set[int] = set()
        self.start = time.time()
        self.tracked = 0.0
        self.faults_log = open(work / "faults.log", "w")

    def say(self, message: str) -> None:
        line = f"{time.time() - self.start:8.2f} s {message}"
        self.faults_log.write(line + "\n")
        self.faults_log.flush()
        logger.info("%s: %s", self.launcher, line)

    # -- processes ---------------------------------------------------------------------------
    def start_server(self) -> None:
        command = [sys.executable, "-m", "rdzv", "serve", "--host", HOST,
                   "--port", str(self.job.spec.port), "--log-level", "WARNING"]
        server = self.job.spawn(command, "server.log")

        def listening() -> bool:
            if server.poll() is not None:
                raise RuntimeError(f"rdzv serve exited with code {server.returncode}")
            socket.create_connection((HOST, self.job.spec.port), timeout=1.0).close()
            return True

        try:
            eventually(listening, SERVER_TIMEOUT, f"rdzv serve on port {self.job.spec.port}",
                       ignoring=(OSError,))
        except (AssertionError, RuntimeError) as exc:
            raise RuntimeError(f"rdzv serve on port {self.job.spec.port} did not start ({exc}): "
                               + (self.work / "server.log").read_text(errors="replace")[-2000:]
                               ) from None

    def service(self) -> None:
        """One tick: resume the stops that are due, note which processes belong to which node,
        and report agents that ended without being asked to."""
        now = time.monotonic()
        for node, (due, pids) in list(self.stopped.items()):
            if now >= due:
                send(pids + self.job.tree(node), signal.SIGCONT)
                del self.stopped[node]
                self.say(f"SIGCONT node {node}")
        if now >= self.tracked + TRACK_EVERY:
            self.job.track()
            self.tracked = now
        for node, process in enumerate(self.job.nodes):
            code = process.poll()
            if code is not None and node not in self.reported:
                self.reported.add(node)
                expected = node in self.removed
                self.say(f"node {node}'s agent exited with code {code}"
                         + ("" if expected else " (no fault asked it to)"))
                if not expected:
                    self.notes.append(f"node {node}'s agent exited with code {code} at "
                                      f"{time.time() - self.start:+.1f} s, unasked: see "
                                      f"{self.work / f'node{node}.log'}")

    def sleep_until(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.service()
            time.sleep(min(TICK, max(0.0, deadline - time.monotonic())))

    def running(self, node: int) -> bool:
        return node < len(self.job.nodes) and self.job.nodes[node].poll() is None

    # -- faults ------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> None:
        node, kind, job = fault.node, fault.kind, self.job
        if kind == "join":
            if node != len(job.nodes):
                raise RuntimeError(f"the schedule starts node {node}, the run has {len(job.nodes)}")
            self.record(fault, job.start())
            return
        if not self.running(node) or node in self.removed:
            self.say(f"{kind} node {node}: not injected, the node is not running")
            self.notes.append(f"{kind} of node {node} at {fault.at:.1f} s not injected: the node "
                              "was not running")
            return
        if kind in REMOVALS:
            self.removed.add(node)
            signum = signal.SIGKILL if kind == "kill" else signal.SIGTERM
            self.record(fault, job.signal_node(node, signum, whole_tree=kind != "leave"))
        elif kind == "stop":
            pids = job.tree(node)
            sent = time.time()
            send(pids, signal.SIGSTOP)
            self.stopped[node] = (time.monotonic() + fault.length, pids)
            self.record(fault, sent)
        elif kind == "worker-crash":
            deadline = time.monotonic() + WORKER_WAIT
            while not (workers := job.workers(node)) and time.monotonic() < deadline:
                self.sleep_until(time.monotonic() + TICK)
            if not workers:
                self.say(f"worker-crash node {node}: not injected, no worker running")
                self.notes.append(f"worker-crash of node {node} at {fault.at:.1f} s not "
                                  "injected: no worker was running")
                return
            sent = time.time()
            send(workers[:1], signal.SIGKILL)
            self.record(fault, sent, f" (pid {workers[0]})")

    def record(self, fault: Fault, sent: float, detail: str = "") -> None:
        self.injected.append(replace(fault, at=sent))
        length = f" for {fault.length:.2f} s" if fault.kind == "stop" else ""
        self.say(f"{fault.kind} node {fault.node}{length}{detail}")

    # -- the run -----------------------------------------------------------------------------
    def warm(self) -> bool:
        """Start the server and the first nodes; whether they trained WARM_STEPS steps at world
        size 3 within START_TIMEOUT."""
        self.start_server()
        for _ in range(3):
            self.job.start()
        self.say("3 nodes started")
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            world = 3 * self.job.spec.nproc
            if sum(e["world_size"] == world for e in self.job.entries()) >= WARM_STEPS:
                return True
            self.sleep_until(time.monotonic() + 0.2)
        self.notes.append(f"the first 3 nodes did not train {WARM_STEPS} steps together within "
                          f"{START_TIMEOUT:g} s")
        return False

    def run(self) -> Observed:
        config = self.config
        started = self.warm()
        self.start = begin = time.time()
        origin = time.monotonic()
        if started:
            self.say(f"window starts: {config.duration:g} s, seed {config.seed}")
            for fault in config.schedule():
                self.sleep_until(origin + fault.at)
                self.inject(fault)
            self.sleep_until(origin + config.duration)
        end = time.time()
        self.say("window ends")
        self.find_orphans()
        self.clean_up()
        steps = parse_steps(self.job.entries())
        checks = parse_checks(read_jsonl(str(self.work / "checks.jsonl")))
        restarts = sum(count_restarts(self.launcher, (self.work / f"node{i}.log").read_text(
            errors="replace")) for i in range(len(self.job.nodes)))
        return Observed(self.launcher, begin, end, steps, checks, tuple(self.injected), restarts,
                        tuple(self.leftovers), self.launcher in IN_PROCESS, started)

    def find_orphans(self) -> None:
        """The processes of a node whose agent has ended are leftovers."""
        self.job.track()
        for node in range(len(self.job.nodes)):
            if not self.running(node):
                for pid in self.job.alive(node):
                    self.orphans.add(pid)
                    self.leftovers.append(f"pid {pid} ({command_of(pid)}) of node {node}, alive "
                                          "after its agent ended")

    def clean_up(self) -> None:
        job = self.job
        job.track()
        for node, (_, pids) in self.stopped.items():
            send(pids + job.tree(node), signal.SIGCONT)
        self.stopped.clear()
        agents = [p for p in job.nodes if p.poll() is None]
        send([p.pid for p in agents], signal.SIGTERM)
        again = time.monotonic() + AGAIN if self.launcher.startswith("rdzv") else None

        def ended() -> bool:
            nonlocal again
            if again is not None and time.monotonic() >= again:
                send([p.pid for p in agents if p.poll() is None], signal.SIGTERM)
                again = None
            job.track()
            return not any(p.poll() is None for p in agents)

        try:
            eventually(ended, CLEANUP_WAIT, "the agents to end after the cleanup's SIGTERM")
        except AssertionError:
            pass  # those still running are named and SIGKILLed below
        for node, process in enumerate(job.nodes):
            if process.poll() is None:
                self.notes.append(f"node {node}'s agent did not end within {CLEANUP_WAIT:g} s "
                                  "of the cleanup's SIGTERM: SIGKILLed")
                send(job.tree(node), signal.SIGKILL)
        send([p.pid for p in job.others], signal.SIGTERM)
        for server in job.others:
            try:
                server.wait(SERVER_TIMEOUT)
            except subprocess.TimeoutExpired:  # the leftover check names it
                pass
        try:  # a second's grace for the processes on their way out
            eventually(lambda: all(pid in self.orphans for pid in job.alive()), 1.0,
                       "the job's processes to end")
        except AssertionError:
            pass  # those still alive are the leftovers, named below
        for pid in job.alive():
            if pid not in self.orphans:
                self.leftovers.append(f"pid {pid} ({command_of(pid)}) alive after the cleanup")
        self.say(f"cleaned up; leftovers: {len(self.leftovers)}")

    def close(self) -> None:
        self.job.kill_all()
        self.faults_log.close()


def command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "gone"


@dataclass(frozen=True)
class Result:
    """One launcher's run: its analysis and what the harness noticed on the way."""

    analysis: Analysis
    notes: tuple[str, ...]


def soak(launcher: str, config: Config, work: Path) -> Result:
    """Run one launcher through the schedule in ``work``."""
    work.mkdir(parents=True)
    run = Soak(launcher, config, work)
    try:
        observed = run.run()
    finally:
        run.close()
    result = Result(analyse(observed, config.limits), tuple(run.notes))
    (work / "summary.json").write_text(json.dumps(
        {**summary(result.analysis), "notes": list(result.notes)}, indent=1) + "\n")
    return result


HEAD = ("launcher", "kind", "faults", "pause median", "pause max", "beyond stop", "redone",
        "skipped", "goodput", "w/o stops", "x rdzv", "restarts", "recovery", "checks",
        "disagree", "hangs", "leftovers")


@dataclass(frozen=True)
class Outcome:
    config: Config
    results: tuple[Result, ...]

    def violations(self) -> list[str]:
        return [v.describe(r.analysis.observed.launcher) for r in self.results
                for v in r.analysis.violations]

    def rows(self) -> list[list[str]]:
        goodputs = {r.analysis.observed.launcher: r.analysis.goodput for r in self.results}
        reference = goodputs.get("rdzv")
        lines = []
        for result in self.results:
            a = result.analysis
            who = a.observed.launcher
            for kind in [k for k in KINDS if a.of_kind(k)]:
                found = a.of_kind(kind)
                pauses = [e.pause for e in found]
                beyond = (f"{max(e.pause - e.fault.length for e in found):+.2f} s"
                          if kind == "stop" else "")
                lines.append([who, kind, str(len(found)), seconds(median(pauses)),
                              seconds(max(pauses)), beyond, str(sum(e.redone for e in found)),
                              str(sum(e.skipped for e in found))] + [""] * 9)
            moving = [e.pause for e in a.effects if e.fault.kind != "stop"]
            lines.append([who, "all", str(len(a.effects)), seconds(median(moving)),
                          seconds(max(moving, default=None)), "",
                          str(sum(e.redone for e in a.effects)),
                          str(sum(e.skipped for e in a.effects)), f"{a.goodput:.3f}",
                          f"{a.goodput_without_stops:.3f}",
                          f"{ratio_of(reference, a.goodput):.2f}x" if reference is not None
                          else "-", str(a.observed.restarts), seconds(a.recovery),
                          str(len(a.window_checks())), str(a.disagreements()), str(a.hangs()),
                          str(len(a.observed.leftovers))])
        return lines

    def report(self) -> str:
        config = self.config
        rows = self.rows()
        widths = [max(len(x) for x in column) for column in zip(HEAD, *rows)]
        out = [f"training chaos soak: seed {config.seed}, {config.duration:g} s window, a fault "
               f"every ~{config.every:g} s ({', '.join(config.kinds)}), nodes {MIN_NODES}:"
               f"{MAX_NODES}, {'2 workers each (HSDP)' if config.sharded else '1 worker each'}, "
               f"{os.cpu_count()} CPUs (load average "
               f"{os.getloadavg()[1]:.1f} over 5 min)", ""]
        out.append(" | ".join(h.ljust(w) for h, w in zip(HEAD, widths)))
        out.append("-+-".join("-" * w for w in widths))
        out += [" | ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in rows]
        out += ["", LEGEND, ""]
        for result in self.results:
            out += [f"note ({result.analysis.observed.launcher}): {n}" for n in result.notes]
        out.append("targets (issue 22):")
        for target in targets([r.analysis for r in self.results], config.limits):
            out.append(f"  {'met   ' if target.met else 'MISSED'} {target.launcher:<18} "
                       f"{target.name}: {target.value}")
        violations = self.violations()
        out.append(f"violations of hard invariants: {len(violations)}")
        out += [f"  {v}" for v in violations]
        return "\n".join(out)

    def as_json(self) -> dict[str, Any]:
        config = self.config
        return {"seed": config.seed, "duration_s": config.duration, "every_s": config.every,
                "kinds": list(config.kinds), "sharded": config.sharded,
                "runs": [{**summary(r.analysis), "notes": list(r.notes)} for r in self.results],
                "targets": [{"name": t.name, "launcher": t.launcher, "value": t.value,
                             "met": t.met}
                            for t in targets([r.analysis for r in self.results], config.limits)]}


LEGEND = """\
pause: longest gap between rank 0's consecutive step lines charged to a fault (a gap goes to the
earliest fault injected inside it, else to the latest before it); "all" rows leave the SIGSTOPs
out of the pause columns; beyond stop: the longest SIGSTOP pause minus its length. redone: lines
of a step already logged; skipped: step numbers never logged. goodput: time in normal steps (a
gap ending in a new step, at most 2x the median step) / the window's wall time; w/o stops: the
SIGSTOPs' pauses (up to their lengths) taken out of the wall time; x rdzv: rdzv's goodput / this
launcher's. restarts: agents' console lines saying they restart their workers. recovery: end of
the last fault -> next new step. checks: rank 0's parameter checks (one per new group);
disagree: checks that found different parameters. See docs/train-chaos.md."""


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def soak_all(launchers: list[str], config: Config, root: Path) -> Outcome:
    return Outcome(config, tuple(soak(launcher, config, root / launcher) for launcher in launchers))


def parse_list(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{flag}: unknown {', '.join(unknown) or '(none given)'};"
                                         f" choose from {', '.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0,
                        help="seconds of the measured window per launcher (default: 120)")
    parser.add_argument("--seed", type=int, default=22, help="the schedule's seed (default: 22)")
    parser.add_argument("--every", type=float, default=8.0,
                        help="mean seconds between two faults (default: 8)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated fault kinds (default: {','.join(KINDS)})")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help=f"comma-separated launchers of {','.join(CHOICES)} (default: "
                             f"{','.join(LAUNCHERS)})")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where each launcher's logs go (default: a new temporary directory)")
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON ('-': stdout)")
    parser.add_argument("--sharded", action="store_true",
                        help="train examples/elastic_fsdp.py (HSDP, 2 workers per node) instead")
    args = parser.parse_args(argv)
    try:
        kinds = parse_list(args.kinds, KINDS, "--kinds")
        launchers = parse_list(args.launchers, CHOICES, "--launchers")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    config = Config(args.duration, args.seed, args.every, kinds, sharded=args.sharded)
    if config.until < args.every:
        parser.error(f"--duration {args.duration:g} leaves no time for faults: give at least "
                     f"{args.every + config.limits.recovery + STOP_LENGTH[1]:g} s")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="rdzv-train-chaos-"))
    if any((root / launcher).exists() for launcher in launchers):
        parser.error(f"--workdir {root} holds an earlier soak's runs: name a new or empty directory")
    logging.basicConfig(level=logging.INFO, format="[train-chaos %(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    logger.info("runs in %s; schedule: %s", root, ", ".join(
        f"{f.at:.1f} s {f.kind} {f.node}" for f in config.schedule()))
    outcome = soak_all(list(launchers), config, root)
    print(outcome.report(), flush=True)
    if args.json:
        text = json.dumps(outcome.as_json(), indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 1 if outcome.violations() else 0


if __name__ == "__main__":
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C or kill: clean up, even if started
        signal.signal(signum, signal.default_int_handler)  # with SIGINT ignored (nohup, &)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("interrupted: every process the soak started has been stopped")
