"""The training chaos soak's fault schedule: one seed gives one list of faults (their times, kinds
and target nodes), the same for every launcher.

Nodes are numbered in the order they start: 0, 1 and 2 start the job, each ``join`` starts the
next number. The schedule follows the population it makes, like a spot cluster: 3 nodes at the
start, between MIN_NODES and MAX_NODES after; a removal (``leave``, ``leave-workers``,
``kill``) drawn while only MIN_NODES are alive becomes a ``join`` (the cluster replaces the lost
node first), a ``join`` drawn at MAX_NODES becomes one of the removals asked for (or nothing).
A fault never targets a node that is stopped then. The first faults are one of each kind asked
for, in a seeded order (a removal that does not fit the population waits, a ``join`` comes
first); then kinds are drawn at random. Faults come every ``every`` seconds, 0.75x to 1.25x at
random; after a SIGSTOP the interval starts at its SIGCONT.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("join", "leave", "leave-workers", "kill", "stop", "worker-crash")
"""``join``: a new node starts; ``leave``: SIGTERM to a node's agent only; ``leave-workers``:
SIGTERM to the agent and its workers at once (as Slurm does); ``kill``: SIGKILL of a node, agent
and all its processes; ``stop``: SIGSTOP of a whole node for STOP_LENGTH seconds, then SIGCONT;
``worker-crash``: SIGKILL of one worker process only, its agent lives."""
REMOVALS = ("leave", "leave-workers", "kill")
PLANNED = ("join", "leave")
"""Planned changes: training goes on through them (no step redone, none skipped). The other kinds
are losses."""
INITIAL_NODES = 3
MIN_NODES = 2
MAX_NODES = 4
STOP_LENGTH = (1.0, 6.0)
"""A SIGSTOP lasts this many seconds (uniform)."""
JITTER = (0.75, 1.25)


@dataclass(frozen=True)
class Fault:
    at: float
    """When: in a schedule, seconds after the start of the measured window; once injected, the
    wall-clock time (``time.time()``) it was sent."""
    kind: str
    node: int
    length: float = 0.0
    """``stop``: seconds from SIGSTOP to SIGCONT."""

    @property
    def end(self) -> float:
        return self.at + self.length


def plan(seed: int, until: float, every: float, kinds: tuple[str, ...]) -> list[Fault]:
    """The faults of ``kinds`` in the first ``until`` seconds (see the module's docstring)."""
    rng = random.Random(seed)
    alive = list(range(INITIAL_NODES))
    started = INITIAL_NODES
    stopped: dict[int, float] = {}
    pending = sorted(kinds)
    rng.shuffle(pending)
    faults: list[Fault] = []
    at = 0.0
    while True:
        at += every * rng.uniform(*JITTER)
        if at > until:
            return faults
        targets = [node for node in alive if stopped.get(node, 0.0) <= at]

        def fits(kind: str, targets: list[int] = targets) -> bool:  # (this round's targets)
            if kind == "join":
                return len(alive) < MAX_NODES
            return bool(targets) and (kind not in REMOVALS or len(alive) > MIN_NODES)

        kind = next((k for k in pending if fits(k)), None)
        if kind is None:  # a pending removal waits for a join; else a kind at random
            kind = "join" if pending and fits("join") else rng.choice(kinds)
        if kind in pending:
            pending.remove(kind)
        if kind in REMOVALS and not fits(kind):
            kind = "join"
        if kind == "join" and not fits(kind):
            removals = [k for k in kinds if k in REMOVALS and fits(k)]
            if not removals:
                continue
            kind = rng.choice(removals)
        if not fits(kind):
            continue
        if kind == "join":
            faults.append(Fault(round(at, 3), kind, started))
            alive.append(started)
            started += 1
            continue
        node = rng.choice(targets)
        length = round(rng.uniform(*STOP_LENGTH), 3) if kind == "stop" else 0.0
        faults.append(Fault(round(at, 3), kind, node, length))
        if kind == "stop":
            stopped[node] = at + length
            at += length  # the next interval starts at the SIGCONT
        if kind in REMOVALS:
            alive.remove(node)
