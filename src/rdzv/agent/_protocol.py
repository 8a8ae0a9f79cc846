"""One node's protocol as a pure state machine: :func:`step` maps the node's state and one event
to its next state and the actions its executor (``_node.py``) carries out.

Phases of a node::

    FORMING ---formed---> SETTLING ---record final---> AWAITING ---decision---+
       ^                                                                      |
       |     cancel / a participant lost / a worker crashed before it         |
       +----------------------------------------------------------------------+
       |                                                                      v
       |   abandon: a participant lost, a worker broke or crashed   ENTERING (switch, recover)
       +--------------------------------------------------------------+       |
       |                                                                      | every worker in
       |   a change: a node waits / leaves / is lost, a worker broke or       v
       +---crashed, a restarted worker is warm------------------------ RUNNING <--- stay, start,
                                                                        |          restart
                   every worker succeeded, or the job finished (finish) --> FINISHED

* **FORMING**: the next round forms in the background (``next_rendezvous``); the workers keep
  training (a planned change) or wait with their group broken (a loss).
* **SETTLING**: the round formed. The node writes its record (what each worker slot holds) and
  makes it final once its workers are settled: a newcomer first learns from group rank 0's hint
  whether the job runs in-process, and then starts its workers at once so they are warm.
* **AWAITING**: group rank 0 waits for every final record and writes the one decision
  (``_decide.decide``, fenced); the others wait for it. A participant lost before the decision
  makes a node write ``cancel`` instead (the same fenced write: the first one wins), and every
  node joins the next round.
* **ENTERING**: the workers got their plans (switch at a step, or recover now) and move to the
  new group; once every one is in, the node runs in the round. A participant lost now (or a
  worker that breaks or crashes while entering) makes the node abort its workers' group, mark
  the round abandoned (the others see it at once) and join the next round, as a recovery. So
  does a worker told to abort its old group that has not shown that it left it: asked where it
  is ``ABORT_PROBE`` after the abort, it still waits in a collective, or it gave no sign within
  its abort bound (``_moves.abort_due``); it is left out of the next group until it shows.
* **RUNNING**: any change starts the next transition: a node waiting to join, a member leaving
  or lost (the workers' group is aborted first, so a collective waiting on a lost peer fails at
  once), a worker whose group broke, a crashed worker (restarted alone, in the background, as a
  warm newcomer; the others recover without it and it joins once warm; when the node's workers
  shard the model together, ``Shards``, the others are ended and restarted with it: they join
  from another node's replica), a worker that failed
  outside the API (a restart of every worker: the only fallback, counted).

A node asked to leave (SIGTERM or SIGINT, to the agent or its workers) while running announces
it and stops its workers at the step the others switch at; asked during a transition, it leaves
once the transition is over. Nothing here does I/O or reads a clock: ``now`` comes with each
event, and the tables of ``tests/agent/test_node_protocol.py`` play every overlap.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from ._flags import DEFAULTS
from ._records import Assignment, Decision, NodeRecord, SlotState

Phase = enum.Enum("Phase", ["FORMING", "SETTLING", "AWAITING", "ENTERING", "RUNNING",
                            "FINISHED", "EXITED"])


class Worker(enum.Enum):
    """A worker slot as its agent sees it."""

    STARTING = "starting"
    """Started, not connected yet (``join``: started to join a running group, without state)."""
    RUNNING = "running"
    BROKEN = "broken"
    FRESH = "fresh"
    """A connected joiner without state, waiting for its plan."""
    ENTERED = "entered"
    """In the group of the round being entered."""
    DONE = "done"
    """Exited 0."""
    LEFT = "left"
    GONE = "gone"
    """Stopped or failed; nothing of it is left."""
    ENDING = "ending"
    """Ended by its agent, to start again with its node's other workers (a sharded model lost
    a shard): started to join once its exit is seen."""


@dataclass(frozen=True)
class Slot:
    state: Worker = Worker.STARTING
    step: int | None = None
    step_time: float | None = None
    sampled: float = 0.0
    """When the worker last made progress (a step reported, a group entered, connected)."""
    longest: float = 0.0
    """The slowest step time it reported (the default hang timeout follows it)."""
    compute: float | None = None
    wait: float | None = None
    """Its recent seconds per step in its own code and waiting for the others."""
    probed: float | None = None
    """When it was asked where it is, silent too long (None: no question pending)."""
    recheck: float = 0.0
    """It waits in a collective for another rank: when to ask again."""
    noted: bool = False
    """That wait was said on the console."""
    hung: bool = False
    """Declared hung: it is being ended."""
    join: bool = False
    """Started to join a running group (it takes its rank from its plan): nobody waits for it;
    it is absent from the rounds until it is warm (connected), then its node brings it in."""
    batch: int | None = None
    """A joiner started with every other worker of its node: the provisional group they set up
    in together (numbered by the node's restarts; None: it joins alone)."""
    aborted_at: float | None = None
    """When its agent aborted its group, if it has not shown since that it left it (by
    reporting the failure, taking the plan of the round entered (``Moving``), entering a
    group, or being a new process)."""
    abort_probed: float | None = None
    """When it was asked where it is, not having shown that (``_moves.abort_due``)."""
    stuck: bool = False
    """It did not show that: asked, it was still blocked in a collective, or it gave no sign
    within its abort bound (gloo can leave a collective waiting on a closed peer). The groups
    form without it until it shows, or until its own abort watch ends it and it restarts
    alone."""

    def report(self, inprocess: bool | None) -> SlotState:
        """What the node's record says of this slot. ``inprocess``: whether the node's workers
        use the in-process API; a started worker of a program without it never connects and
        holds its state all the same."""
        if self.stuck and self.state is Worker.BROKEN:  # (as good as absent, until it shows)
            return SlotState.ABSENT
        if self.state in (Worker.RUNNING, Worker.ENTERED):
            return SlotState.RUNNING
        if self.state is Worker.BROKEN:
            return SlotState.BROKEN
        if self.state is Worker.FRESH:
            return SlotState.FRESH
        if self.state is Worker.STARTING and not self.join:
            return SlotState.RUNNING if inprocess is False else SlotState.STARTING
        return SlotState.ABSENT


@dataclass(frozen=True)
class Group:
    """The group the node's workers are in: its store prefix, this node's first global rank in
    it, its world size, and which of this node's workers are in it (in global rank order)."""

    prefix: str
    offset: int
    size: int
    local_ranks: tuple[int, ...]

    def held(self, slots: tuple[Slot, ...]) -> tuple[int, ...]:
        """The global ranks of this node's workers that hold the group's state."""
        return tuple(self.offset + i for i, lr in enumerate(self.local_ranks)
                     if lr < len(slots) and slots[lr].report(True).holds_state)


@dataclass(frozen=True)
class Rules:
    """The node's configuration, as the decisions need it."""

    nproc: int
    max_restarts: int = 0
    switch_timeout: float = DEFAULTS["switch_timeout"]
    leave_grace: float = DEFAULTS["leave_grace"]
    restart_on_change: bool = False
    min_nodes: int = 1
    hosts_store: bool = False
    hang_timeout: float | None = None
    """Seconds without progress before a worker is checked for a hang (None: derived from its
    step time, ``_hang.py``; 0: no watch)."""
    connect_grace: float = DEFAULTS["worker_connect_timeout"]
    """Seconds after their start within which workers that use the in-process API connect to
    their agent (``--worker-connect-timeout``); workers silent longer do not use it. Workers
    started to join a running group wait for each other as long after the first of them
    connected."""


@dataclass(frozen=True)
class Leave:
    signum: int
    deadline: float
    announced: bool = False
    by_worker: bool = False
    """The notice came from a worker (its SIGTERM): the agent's own SIGTERM, which Slurm sends
    together, is the same notice, not a second one."""
    step: int | None = None
    """The step at which the workers stop (the others' switch step), once known."""
    notice: str = ""
    """Who asked, if not a signal (see :class:`Signalled`)."""


@dataclass(frozen=True)
class Node:
    """What a node knows: its phase, its round, its workers and what it wrote."""

    phase: Phase = Phase.FORMING
    gen: int = 0
    """The node's count of rounds formed (tags the events of one round)."""
    group_rank: int = -1
    nodes: int = 0
    slots: tuple[Slot, ...] = ()
    decision: Decision | None = None
    """The decision of round ``gen`` once read."""
    assignment: Assignment | None = None
    """This node's place in round ``gen``."""
    group: Group | None = None
    """The workers' current group."""
    inprocess: bool | None = None
    """This node's workers use the in-process API (they connected to the agent)."""
    sharded: bool = False
    """The workers shard the model among themselves (``Shards``): a crash restarts them all."""
    hint: bool | None = None
    """Group rank 0's word on whether the job runs in-process (for a newcomer)."""
    hint_written: bool = False
    record_final: bool = False
    restart_why: str | None = None
    """A worker failed outside the API (or never connected): every worker restarts."""
    restart_cause: str = ""
    """Why in a word (``rdzv.rendezvous.RESTART_CAUSES``): a label."""
    cancelled: str | None = None
    """Why this node cancelled round ``gen`` (a decision written first makes it abandon it)."""
    failed_transitions: int = 0
    """Transitions in a row that could not complete (abandoned), or whose group failed before a
    step in it: past a bound, the workers restart instead of recovering again."""
    entered_at: int | None = None
    """The step at which the workers entered their group in-process (None: started in it)."""
    restarts: int = 0
    started: float = 0.0
    """When the workers were last started (those that never connect do not use the API)."""
    deadline: float = math.inf
    """When the current phase gives up waiting."""
    entering_since: float = 0.0
    joining: bool = False
    """Every worker of this node entering the group is fresh (it joins the running group)."""
    leave: Leave | None = None
    failures: tuple[str, ...] = field(default=())
    """What failed since the last restart, for the summary."""

    @property
    def coordinator(self) -> bool:
        return self.group_rank == 0

    def recorded_api(self, restart_on_change: bool) -> bool | None:
        """Whether the node's record takes its workers for users of the in-process API (None:
        not known yet). Not under ``--restart-on-change``: every change restarts them, so a
        worker still starting is not waited for (what it would report cannot change the
        round's decision)."""
        return False if restart_on_change else self.inprocess

    @property
    def live(self) -> list[int]:
        return [lr for lr, s in enumerate(self.slots) if s.state not in (
            Worker.DONE, Worker.LEFT, Worker.GONE)]


# -- events ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Formed:
    """The next round formed: this node is ``group_rank`` of ``nodes``."""

    gen: int
    group_rank: int
    nodes: int


@dataclass(frozen=True)
class FormFailed:
    kind: str
    """``closed``, ``spare`` (closed, and this node waited as a spare), ``store`` (its store
    cannot be reached: gone with the node that hosted it?), ``graceful`` (asked to
    leave), ``timeout`` or ``error``."""
    message: str


@dataclass(frozen=True)
class Hinted:
    """Group rank 0's hint for the round: its workers switch in-process (True), or do not use
    the API (False), or none run yet (None: a first start, where nobody can say)."""

    gen: int
    inprocess: bool | None

    WIRE: ClassVar[dict[bool | None, bytes]] = {True: b"1", False: b"0", None: b"-"}

    @classmethod
    def read(cls, gen: int, raw: bytes) -> "Hinted":
        return cls(gen, next((k for k, v in cls.WIRE.items() if v == raw), None))


@dataclass(frozen=True)
class RecordsIn:
    """Group rank 0: every record is final (or ``timed_out``: the wait for them ended)."""

    gen: int
    records: dict[int, NodeRecord | None]
    timed_out: bool = False


@dataclass(frozen=True)
class Decided:
    gen: int
    decision: Decision


@dataclass(frozen=True)
class Assigned:
    gen: int
    assignment: Assignment


@dataclass(frozen=True)
class Abandoned:
    """A participant of round ``gen`` left it after its decision."""

    gen: int


@dataclass(frozen=True)
class Unreadable:
    """Round ``gen``'s decision, or this node's assignment, is in the store but malformed."""

    gen: int
    message: str


@dataclass(frozen=True)
class Changed:
    """The membership of round ``gen`` changed: members ``lost`` (gone without a word),
    ``leaving`` (announced), nodes ``waiting`` to join, members that ``moved`` on already."""

    gen: int
    lost: int = 0
    leaving: int = 0
    waiting: int = 0
    moved: int = 0
    closed: bool = False


@dataclass(frozen=True)
class FromWorker:
    local_rank: int
    message: Any
    """A worker's message (``_messages``), or Closed."""


@dataclass(frozen=True)
class Exited:
    local_rank: int
    code: int
    """The exit code; negative: killed by that signal."""
    error: str = ""
    """The first line of the error the worker recorded, if any."""


@dataclass(frozen=True)
class Signalled:
    signum: int
    notice: str = ""
    """Who asks this node to leave, if not a signal (a straggler replaced: ``Evicted``)."""


@dataclass(frozen=True)
class Evicted:
    """Group rank 0 asks this node to leave gracefully (``why``): a spare takes its place."""

    why: str


@dataclass(frozen=True)
class Expired:
    """This node's store session expired (it was paused past its ttl): the others took it for
    gone."""

    why: str


@dataclass(frozen=True)
class LeaveFailed:
    """This node could not announce that it leaves (``why``)."""

    why: str


@dataclass(frozen=True)
class NextSeen:
    """A leaving node: how the others moved on (None: they did not say within the grace)."""

    decision: Decision | None


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class AllFinished:
    gen: int


Event = Union[Formed, FormFailed, Hinted, RecordsIn, Decided, Assigned, Abandoned, Changed,
              FromWorker, Exited, Signalled, Evicted, Expired, LeaveFailed, NextSeen, Tick,
              AllFinished]


# -- actions ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Act:
    """One thing for the executor to do: ``what`` names it, ``args`` are its arguments.

    ``join`` (the next round, in the background), ``watch`` (round ``gen``: its membership and
    decision), ``record`` (write this node's record), ``hint`` (True, False, or None: nobody
    runs yet), ``decide`` (records, timed out),
    ``cancel``, ``abandon``, ``fetch`` (this node's assignment), ``plans`` (to the workers),
    ``abort``, ``start`` (workers: join?), ``replace`` (local rank: a crashed worker, alone),
    ``stop`` (signal), ``announce`` (this node leaves), ``leave_plans`` (step), ``next``
    (tell the old round's leavers), ``adopt`` (the workers run in the round), ``done``
    (mark finished, and wait for every node's mark), ``outside`` (mark this node, none of whose
    workers is in the group, as one the others' end does not wait for), ``close`` (reason),
    ``exit`` (code), ``say`` (text), ``event`` (history), ``probe`` (local rank: where is
    it?), ``hung`` (local rank, global rank, step, silent s, why, frame).
    """

    what: str
    args: tuple[Any, ...] = ()


def act(what: str, *args: Any) -> Act:
    return Act(what, args)


Result = tuple[Node, list[Act]]


