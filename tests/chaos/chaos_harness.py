"""The chaos soak (issue 17): real node processes rendezvous on a real store while a seeded
schedule injects faults; then the merged histories are checked (chaos_checks).

``python tests/chaos/chaos_harness.py --backend tcp|etcd|both --duration 30 --seed 17``
(``scripts/chaos`` runs it with the project's venv). Exits 1 on any violation, printing the
violating rounds. One seed gives one schedule of faults (their times and kinds; a target is
drawn from the nodes alive then, in name order). Faults:

* ``kill``: SIGKILL a node; ``pause``: SIGSTOP a node for 1 to ``pause_max`` seconds, then
  SIGCONT (the session ttl is 2 s, so most pauses outlive the node's session);
* ``join``: start a node; ``spares``: start nodes until there are more than ``max_nodes``;
* ``leave``: a graceful leave (``announce_leaving()``, then the node exits);
* ``seal_pause``: the next node to seal a round stops itself right after listing the joiners,
  and is resumed past the ttl (a node is started, so that a round forms);
* ``server``: SIGKILL the tcp store server (restarted on its ``--data-dir``) or the etcd
  leader (restarted), rarely.

The faults stop once the last paused node is resumed; then the soak waits until every alive
node is in one round that held ``hold`` seconds (at most ``recovery_bound`` seconds), reads
each round's decision back from the store (the audit), and stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # _launcher, when run as a script

from _launcher import Launcher, LoggedProcess  # noqa: E402
from chaos_backends import AckChecker, Backend, EtcdBackend, TcpBackend  # noqa: E402
from chaos_checks import Event, Limits, Violation, check_all, figures, settled  # noqa: E402

NODE = str(Path(__file__).resolve().parent / "chaos_node.py")
KINDS = {"kill": 3, "pause": 3, "join": 3, "leave": 2, "spares": 1, "seal_pause": 2, "server": 1}
"""Fault kinds and their weights; the first faults of a schedule are one of each kind."""
TTL = 2.0
RUN_ID = "chaos"
OPTIONS = ("heartbeat_interval=0.5&heartbeat_misses=4&last_call_timeout=0.5&read_timeout=5"
           "&join_timeout=60&close_timeout=2&local_addr=127.0.0.1")
TICK = 0.05
ARMED_FOR = 10.0
"""Seconds a seal pause stays armed when no round is sealed meanwhile."""
LEAVE_GRACE = 15.0
SHOWN = 10
"""Violations printed in full."""


@dataclass(frozen=True)
class Config:
    backend: str
    seed: int = 17
    duration: float = 30.0
    min_nodes: int = 2
    max_nodes: int = 4
    initial_nodes: int = 4
    pause_max: float = 20.0
    gap: tuple[float, float] = (1.0, 3.0)
    """Seconds between two faults."""
    recovery_bound: float = 30.0
    hold: float = 5.0
    etcd_binary: str | None = None

    @property
    def limits(self) -> Limits:
        return Limits(self.min_nodes, self.max_nodes, self.recovery_bound, self.hold)


def plan(seed: int, duration: float, gap: tuple[float, float]) -> list[tuple[float, str]]:
    """The schedule: (seconds from the start, kind); one of each kind first, in a seeded order."""
    rng = random.Random(seed)
    first = sorted(KINDS)
    rng.shuffle(first)
    schedule: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rng.uniform(*gap)
        if t >= duration:
            return schedule
        kind = first.pop() if first else rng.choices(list(KINDS), list(KINDS.values()))[0]
        schedule.append((t, kind))


class Soak:
    """Runs one backend's soak in ``workdir``; stops every process it started on exit."""

    def __init__(self, config: Config, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        (workdir / "nodes").mkdir(parents=True)
        self.launcher = Launcher(workdir, "proc")
        self.rng = random.Random(config.seed + 1)
        self.events: list[Event] = []
        self.nodes: dict[str, LoggedProcess] = {}
        """The nodes alive (paused ones included), by name."""
        self.leaving: dict[str, float] = {}
        self.paused: dict[str, float] = {}
        """Paused nodes and when to resume them."""
        self.armed: float | None = None
        self.pause_file = workdir / "pause-seal"
        self.offsets: dict[str, int] = {}
        self.count = 0
        self.backend: Backend = (TcpBackend(workdir, self.launcher) if config.backend == "tcp"
                                 else EtcdBackend(config.etcd_binary))
        self.deadline = 0.0
        self.checker: AckChecker | None = None

    # -- events ------------------------------------------------------------------------------
    def record(self, ev: str, **fields: Any) -> None:
        self.events.append({"t": time.time(), "ev": ev, **fields})

    def node_events(self) -> list[Event]:
        found = []
        for path in sorted((self.workdir / "nodes").glob("*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    found.append(json.loads(line))
        return found

    def all_events(self) -> list[Event]:
        return sorted(self.events + self.node_events(), key=lambda e: e["t"])

    def new_node_events(self) -> Iterator[Event]:
        """Events the nodes wrote since the last call."""
        for path in (self.workdir / "nodes").glob("*.jsonl"):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path.name, 0))
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]
            self.offsets[path.name] = self.offsets.get(path.name, 0) + len(complete)
            for line in complete.splitlines():
                yield json.loads(line)

    # -- nodes -------------------------------------------------------------------------------
    def start_node(self) -> str:
        name = f"n{self.count:03d}"
        self.count += 1
        options = f"{OPTIONS}&min_nodes={self.config.min_nodes}&max_nodes={self.config.max_nodes}"
        spec = {"url": self.backend.url(RUN_ID, options),
                "name": name, "history": str(self.workdir / "nodes" / f"{name}.jsonl"),
                "seed": self.config.seed * 1000 + self.count, "deadline": self.deadline,
                "step": [0.2, 1.0], "members_timeout": 3.0,
                "leave_file": str(self.workdir / f"leave-{name}"),
                "pause_file": str(self.pause_file)}
        self.nodes[name] = self.launcher.start([sys.executable, NODE, json.dumps(spec)])
        self.record("start", node=name, pid=self.nodes[name].pid)
        return name

    def active(self) -> list[str]:
        """Nodes that count: alive, not paused, not leaving."""
        return sorted(n for n in self.nodes if n not in self.paused and n not in self.leaving)

    def pause(self, name: str, seconds: float) -> None:
        self.nodes[name].signal(signal.SIGSTOP)
        self.paused[name] = time.monotonic() + seconds

    def service(self) -> None:
        """One tick: resume due pauses, notice sealers that paused themselves, reap exits."""
        now = time.monotonic()
        for name, due in list(self.paused.items()):
            if now >= due:
                self.nodes[name].signal(signal.SIGCONT)
                del self.paused[name]
                self.record("resumed", node=name)
        for event in self.new_node_events():
            if event["ev"] == "seal_pause" and event["node"] in self.nodes:
                self.armed = None
                self.paused[event["node"]] = now + TTL + self.rng.uniform(1.0, 4.0)
        if self.armed is not None and now > self.armed:
            self.pause_file.unlink(missing_ok=True)
            self.armed = None
            self.record("disarmed")
        for name, process in list(self.nodes.items()):
            code = process.process.poll()
            if code is None and name in self.leaving and now > self.leaving[name]:
                self.record("error", node=name, type="leave did not end", expected=False,
                            message=f"still running {LEAVE_GRACE:g} s after its leave")
                process.kill()
                code = -9
            if code is not None:
                del self.nodes[name]
                self.paused.pop(name, None)
                if self.leaving.pop(name, None) is None or code != 0:
                    self.record("error", node=name, type=f"exit {code}", expected=False,
                                message=process.output()[-1500:])

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.service()
            time.sleep(TICK)

    # -- faults ------------------------------------------------------------------------------
    def adjust(self, kind: str) -> str | None:
        """The fault to inject instead of ``kind`` given the nodes now (None: none), keeping
        between ``min_nodes + 1`` and ``max_nodes + 2`` nodes and one stale sealer at a time."""
        active, low, high = len(self.active()), self.config.min_nodes + 1, self.config.max_nodes + 2
        if kind == "seal_pause" and (self.armed is not None or self.paused):
            kind = "join"
        if kind in ("kill", "pause", "leave") and active <= low:
            kind = "join"
        if kind in ("join", "spares", "seal_pause") and len(self.nodes) >= high:
            return "kill" if active > low else None
        return kind

    def inject(self, planned: str) -> None:
        kind = self.adjust(planned)
        if kind is None:
            return
        target: str | None = None
        detail: Any = None
        if kind in ("kill", "pause", "leave"):
            name = target = self.rng.choice(self.active())
            if kind == "kill":
                self.nodes.pop(name).kill()
            elif kind == "pause":
                detail = round(self.rng.uniform(1.0, self.config.pause_max), 2)
                self.pause(name, detail)
            else:
                (self.workdir / f"leave-{name}").touch()
                self.leaving[name] = time.monotonic() + LEAVE_GRACE
        elif kind == "join":
            target = self.start_node()
        elif kind == "spares":
            more = self.config.max_nodes + self.rng.randint(1, 2) - len(self.nodes)
            detail = [self.start_node() for _ in range(more)]
        elif kind == "seal_pause":
            self.pause_file.touch()
            self.armed = time.monotonic() + ARMED_FOR
            target = self.start_node()  # a round forms
        self.record("fault", kind=kind, target=target, detail=detail)
        if kind == "server":
            self.server_fault()

    def server_fault(self) -> None:
        killed = self.backend.kill_server()
        self.events[-1]["target"] = killed
        self.sleep(self.rng.uniform(0.5, 3.0))
        self.backend.restart_server()
        self.record("server_up")
        assert self.checker is not None
        acked, missing = self.checker.missing()
        self.record("ack_check", acked=acked, missing=missing)

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> None:
        config = self.config
        schedule = plan(config.seed, config.duration, config.gap)
        self.deadline = time.time() + config.duration + config.recovery_bound + 120.0
        self.backend.start()
        self.checker = checker = AckChecker(self.backend.client)
        checker.start()
        for _ in range(config.initial_nodes):
            self.start_node()
        start = time.monotonic()
        for offset, kind in schedule:
            self.sleep(start + offset - time.monotonic())
            self.inject(kind)
        self.sleep(start + config.duration - time.monotonic())
        self.pause_file.unlink(missing_ok=True)
        self.armed = None
        self.sleep(max([0.0, *self.paused.values()]) - time.monotonic())  # the last pause ends
        self.record("faults_end")
        self.settle()
        self.audit()
        acked, missing = checker.missing()
        self.record("ack_check", acked=acked, missing=missing)
        self.record("end", alive=sorted(self.nodes))

    def audit(self) -> None:
        """Record each round's decision as its store holds it now: the status and the rank
        keys left (a member deletes its own once it has moved on)."""
        from rdzv.rendezvous._layout import RunKeys

        keys = RunKeys(RUN_ID)
        rounds = sorted({e["round"] for e in self.node_events() if e["ev"] == "joined"})
        store = self.backend.client()
        try:
            for r in rounds:
                status, rank_dir = store.try_get(keys.status(r)), keys.rank(r, "")
                ranks = store.list_keys(rank_dir)
                self.record("decision", round=r, status=status and json.loads(status),
                            ranks={key[len(rank_dir):]: json.loads(value)
                                   for key, value in ranks.items()})
        finally:
            store.close()

    def settle(self) -> None:
        """Wait until the alive nodes are in one round that held ``hold`` s (bounded)."""
        config = self.config
        end = time.monotonic() + config.recovery_bound + config.hold
        while time.monotonic() < end:
            self.sleep(0.5)
            if self.leaving or self.paused:
                continue
            state = settled(self.all_events(), self.nodes, config.limits)
            if not state.problem and time.time() - state.since >= config.hold:
                return

    def close(self) -> None:
        if self.checker is not None:
            self.checker.stop()
        for process in self.nodes.values():
            process.signal(signal.SIGCONT)
        self.launcher.kill_all()
        self.backend.close()


@dataclass(frozen=True)
class Outcome:
    config: Config
    workdir: Path
    figures: dict[str, Any]
    violations: list[Violation]

    def report(self) -> str:
        lines = [f"chaos soak: backend {self.config.backend}, seed {self.config.seed}, "
                 f"{self.config.duration:g} s of faults, nodes {self.config.min_nodes}:"
                 f"{self.config.max_nodes}, histories in {self.workdir}"]
        lines += [f"  {name}: {value}" for name, value in self.figures.items()]
        checks = Counter(v.check for v in self.violations)
        lines.append(f"  violations: {len(self.violations)} {dict(sorted(checks.items()))}")
        lines += [v.describe() for v in self.violations[:SHOWN]]
        if len(self.violations) > SHOWN:
            lines.append(f"... and {len(self.violations) - SHOWN} more violations "
                         f"(all events: {self.workdir / 'history.jsonl'})")
        return "\n".join(lines)


def soak(config: Config, workdir: Path) -> Outcome:
    run = Soak(config, workdir)
    try:
        run.run()
    finally:
        run.close()
    events = run.all_events()  # once every node is stopped: one consistent cut
    with open(workdir / "history.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    return Outcome(config, workdir, figures(events), check_all(events, config.limits))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("tcp", "etcd", "both"), default="both")
    parser.add_argument("--duration", type=float, default=60.0,
                        help="seconds of faults per backend (default: 60)")
    parser.add_argument("--seed", type=int, default=17, help="the schedule's seed (default: 17)")
    parser.add_argument("--pause-max", type=float, default=20.0,
                        help="longest SIGSTOP of a node in seconds (default: 20)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where histories and logs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="rdzv-chaos-"))
    if args.workdir is not None and any(args.workdir.glob("*/nodes")):
        parser.error(f"--workdir {args.workdir} holds an earlier soak's histories: "
                     "name a new or empty directory")
    failed = False
    for backend in ("tcp", "etcd") if args.backend == "both" else (args.backend,):
        config = replace(Config(backend), seed=args.seed, duration=args.duration,
                         pause_max=args.pause_max)
        outcome = soak(config, root / backend)
        print(outcome.report(), flush=True)
        failed = failed or bool(outcome.violations)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
