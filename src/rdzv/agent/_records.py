"""What the agents of a round write to agree on how it starts: each node's record, and the one
decision of the round with every node's assignment.

Every round of ``rdzv run`` starts the same way (``_decide.py`` has the rules, ``_node.py`` the
executor): each node writes its :class:`NodeRecord` (what its workers hold: running at a step,
broken at a step, fresh, starting, absent), group rank 0 reads them all once every record is
final and writes the round's one :class:`Decision`; every node reads it and its own
:class:`Assignment` and acts on them, nothing else. The decision key is written with a fenced
conditional write (``compare_set`` on a missing key): the first writer wins, which is either the
coordinator's decision or a ``cancel`` written by a node that saw a participant lost first.
The assignments are written before, under the decision's own id, so a decision never names
assignments of another (a losing writer's are never read).

All values are versioned JSON; a malformed one is a RendezvousStateError naming the key.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from ..errors import RendezvousStateError

VERSION = 1


class SlotState(enum.Enum):
    """What one worker slot of a node holds, as its agent reports it."""

    RUNNING = "running"
    """Connected and training in the node's group: it holds the training state."""
    BROKEN = "broken"
    """Its group failed; it holds the state of its ``step`` and waits."""
    FRESH = "fresh"
    """Connected, warm, without state: it joins and receives the state."""
    STARTING = "starting"
    """Started, not connected yet (its record is not final while it may still connect)."""
    ABSENT = "absent"
    """No process: it died and a replacement warms up (it joins a later round)."""

    @property
    def holds_state(self) -> bool:
        return self in (SlotState.RUNNING, SlotState.BROKEN)


@dataclass(frozen=True)
class SlotReport:
    state: SlotState
    step: int | None = None


@dataclass(frozen=True)
class NodeRecord:
    """One node's record in a round."""

    slots: tuple[SlotReport, ...]
    role: str
    host: str
    port: int
    """A port this node holds for the store of a new group whose global rank 0 it runs."""
    final: bool
    inprocess: bool | None = None
    """Its workers use the in-process API (None: not known yet)."""
    restart: str | None = None
    """Why this node needs every worker restarted (a worker failed outside the API), if so."""
    restart_cause: str = ""
    """That reason in a word (``rdzv.rendezvous.RESTART_CAUSES``)."""
    lineage: str | None = None
    """The prefix of the group its state-holding workers are in."""
    offset: int | None = None
    """Its first global rank in that group."""
    group_size: int | None = None
    """That group's world size."""
    held: tuple[int, ...] = ()
    """The global ranks (in that group) of this node's workers that hold its state."""
    leaving: tuple[int, ...] = ()
    """The global ranks (in that group) of nodes that announced their leave, as this node saw
    them: with ``held``, every rank of a group is accounted for, or the group lost a member."""
    step_time: float | None = None
    sampled: float = 0.0
    """The wall time at which the steps were sampled."""
    node_id: str | None = None
    pid: int = 0
    time: float = 0.0
    join_s: float = 0.0
    max_nodes: int | None = None
    started: float = 0.0
    """The wall time its agent started (``rdzv status``'s *up*)."""
    finished: bool = False
    """Its workers finished the job (each exited 0): it waits for the other nodes."""

    @property
    def present(self) -> list[int]:
        """The local ranks that take part in the round's group (not absent)."""
        return [lr for lr, slot in enumerate(self.slots) if slot.state is not SlotState.ABSENT]


class Kind(enum.Enum):
    """How a round starts (see ``_decide.decide``)."""

    START = "start"
    """No worker runs: every node starts its workers."""
    RESTART = "restart"
    """Every node stops its workers and starts them anew (they resume from a checkpoint)."""
    SWITCH = "switch"
    """A planned change: the running workers move to the new group at step ``step``."""
    RECOVER = "recover"
    """The group is broken: every worker moves to the new group now, adopting ``source``'s
    state."""
    STAY = "stay"
    """The running group is the round's group: nothing changes for the workers."""
    CANCEL = "cancel"
    """A participant was lost before a decision: every node joins the next round."""
    FINISH = "finish"
    """The job is over: a node's workers finished it and no worker holds a training state
    (a node that came as it ended): nobody starts anything, every node ends."""


@dataclass(frozen=True)
class Decision:
    kind: Kind
    id: str
    by: str = ""
    why: str = ""
    step: int | None = None
    source: int | None = None
    prefix: str = ""
    master_addr: str = ""
    master_port: int = 0
    world_size: int = 0
    nodes: int = 0
    receivers: int = 0
    """How many workers receive the state (newcomers and survivors behind the source)."""
    cause: str = ""
    """A restart's cause (``rdzv.rendezvous.RESTART_CAUSES``)."""


@dataclass(frozen=True)
class Assignment:
    """This node's place among all workers of a round."""

    group_rank: int
    group_world_size: int
    rank_offset: int
    """Global rank of this node's first present worker."""
    world_size: int
    role_rank_offset: int
    role_world_size: int
    master_addr: str
    master_port: int
    local_ranks: tuple[int, ...] = field(default=())
    """The node's workers in the group, in global rank order (those not absent)."""

    def global_rank(self, local_rank: int) -> int:
        return self.rank_offset + self.local_ranks.index(local_rank)


def _dumps(kind: str, value: Any) -> str:
    data = asdict(value)
    for name, item in list(data.items()):
        if isinstance(item, enum.Enum):
            data[name] = item.value
    return json.dumps({"v": VERSION, "t": kind, **data}, separators=(",", ":"))


def _loads(key: str, raw: bytes, kind: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("t") != kind:
        raise RendezvousStateError(f"agent key {key!r} does not hold an agent {kind}: "
                                   f"{raw[:60]!r}")
    if data.get("v") != VERSION:
        raise RendezvousStateError(f"agent key {key!r} holds a {kind} of version "
                                   f"{data.get('v')!r}; this agent reads {VERSION}: run one "
                                   "rdzv version on every node")
    return data


def _check(key: str, ok: bool, what: str) -> None:
    if not ok:
        raise RendezvousStateError(f"agent key {key!r}: {what}")


def _is_int(value: Any, optional: bool = False) -> bool:
    return (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool))


def _is_number(value: Any, optional: bool = False) -> bool:
    return (value is None and optional) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def dumps_record(record: NodeRecord) -> str:
    fields = {k: list(v) if isinstance(v, tuple) else v
              for k, v in asdict(record).items() if k != "slots"}
    return json.dumps({"v": VERSION, "t": "record", **fields, "nproc": len(record.slots),
                       "slots": [[s.state.value, s.step] for s in record.slots]},
                      separators=(",", ":"))


def loads_record(key: str, raw: bytes) -> NodeRecord:
    data = _loads(key, raw, "record")
    slots = data.get("slots")
    _check(key, isinstance(slots, list) and all(
        isinstance(s, list) and len(s) == 2 and _is_int(s[1], True) for s in slots),
        "malformed slots")
    try:
        reports = tuple(SlotReport(SlotState(state), step)
                        for state, step in cast("list[list[Any]]", slots))
    except ValueError:
        raise RendezvousStateError(f"agent key {key!r}: unknown slot state") from None
    for name in ("port", "pid", "offset", "group_size", "max_nodes"):
        _check(key, _is_int(data.get(name), name not in ("port", "pid")), f"malformed {name}")
    for name in ("step_time", "sampled", "time", "join_s"):
        _check(key, _is_number(data.get(name), name == "step_time"), f"malformed {name}")
    _check(key, _is_number(data.get("started", 0.0)), "malformed started")
    for name in ("role", "host"):
        _check(key, isinstance(data.get(name), str), f"malformed {name}")
    _check(key, isinstance(data.get("restart_cause"), str), "malformed restart_cause")
    for name in ("restart", "lineage", "node_id"):
        _check(key, data.get(name) is None or isinstance(data[name], str), f"malformed {name}")
    for name in ("held", "leaving"):
        _check(key, isinstance(data.get(name), list) and all(_is_int(r) for r in data[name]),
               f"malformed {name}")
    _check(key, isinstance(data.get("final"), bool) and data.get("inprocess") in (None, True,
                                                                                    False)
           and isinstance(data.get("finished", False), bool), "malformed flags")
    return NodeRecord(slots=reports, role=data["role"], host=data["host"], port=data["port"],
                      final=data["final"], inprocess=data["inprocess"], restart=data["restart"],
                      restart_cause=data["restart_cause"],
                      lineage=data["lineage"], offset=data["offset"],
                      group_size=data["group_size"], held=tuple(data["held"]),
                      leaving=tuple(data["leaving"]), step_time=data["step_time"],
                      sampled=data["sampled"], node_id=data["node_id"], pid=data["pid"],
                      time=data["time"], join_s=data["join_s"], max_nodes=data["max_nodes"],
                      started=data.get("started", 0.0), finished=data.get("finished", False))


def dumps_decision(decision: Decision) -> str:
    return _dumps("decision", decision)


def loads_decision(key: str, raw: bytes) -> Decision:
    data = _loads(key, raw, "decision")
    try:
        kind = Kind(data.get("kind"))
    except ValueError:
        raise RendezvousStateError(f"agent key {key!r}: unknown decision kind "
                                   f"{data.get('kind')!r}") from None
    for name in ("id", "by", "why", "prefix", "master_addr", "cause"):
        _check(key, isinstance(data.get(name), str), f"malformed {name}")
    for name in ("step", "source"):
        _check(key, _is_int(data.get(name), True), f"malformed {name}")
    for name in ("master_port", "world_size", "nodes", "receivers"):
        _check(key, _is_int(data.get(name)), f"malformed {name}")
    return Decision(kind=kind, **{k: data[k] for k in (
        "id", "by", "why", "step", "source", "prefix", "master_addr", "master_port",
        "world_size", "nodes", "receivers", "cause")})


def dumps_assignment(assignment: Assignment) -> str:
    return _dumps("assignment", assignment)


def loads_assignment(key: str, raw: bytes) -> Assignment:
    data = _loads(key, raw, "assignment")
    names = ("group_rank", "group_world_size", "rank_offset", "world_size", "role_rank_offset",
             "role_world_size", "master_port")
    for name in names:
        _check(key, _is_int(data.get(name)), f"malformed {name}")
    ranks = data.get("local_ranks")
    _check(key, isinstance(data.get("master_addr"), str) and isinstance(ranks, list)
           and all(_is_int(r) for r in ranks), "malformed address or local ranks")
    return Assignment(master_addr=data["master_addr"],
                      local_ranks=tuple(cast("list[int]", ranks)),
                      **{name: data[name] for name in names})


