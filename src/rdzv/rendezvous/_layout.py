"""The store key layout of a dynamic rendezvous and the versioned JSON encoding of its values.

Every key of run ``<run>`` lives under ``rdzv/<run>/``; round ``r`` under ``rdzv/<run>/round/<r>/``:

===============================  ==================================================================
key                              meaning
===============================  ==================================================================
``closed``                       exists once the rendezvous is closed (``set_closed``)
``sealed``                       the number of the last completed round (written with its decision)
``round/<r>/nodes/<id>``         EPHEMERAL descriptor of joiner ``id`` (its liveness while r forms)
``round/<r>/back/<id>``          EPHEMERAL: joiner ``id`` was a member of round r-1 (a rejoin)
``round/<r>/rank/<id>``          joiner ``id``'s rank and the decision (the sealer's fenced write)
``round/<r>/ctl/status``         the decision once sealed, or ``closed``; absent while forming
``round/<r>/ctl/armed``          written once when the round may complete and min_nodes are alive
``round/<r>/sealer``             EPHEMERAL lock of the one node that lists the joiners and seals
                                 (its node id while held; empty or missing: free; the seal
                                 empties it with the decision's write)
``round/<r+1>/ctl/expect/<id>``  EPHEMERAL: joiner ``id`` of round r is alive (written on joining r)
``round/<r+1>/left/<id>``        why member ``id`` of round r is not coming back (a leave reason,
                                 for the history: read by r+1's sealer, then deleted)
``events/...``                   the run's history (``_history.py``)
``round/<r>/user/...``           the members' own keys (``RendezvousInfo.store``); the agents'
                                 (``rdzv run``) under ``user/agent/`` (``AGENT_*`` below)
===============================  ==================================================================

``<id>`` is the joiner's node id (``host:pid:random``, no ``/``): a joiner's keys need no store
call to name, so its first write already carries its descriptor.

A waiting node watches only ``round/<r>/ctl/``, which changes O(1) times per round plus once per
departure of a previous member (never once per join, nor when a node takes the sealer lock), so a
round costs each node O(1) wake-ups.
The counts a node needs (alive joiners, rejoined members, alive previous members, nodes waiting)
come from ``count_keys`` and cost O(1) each.

A decision (the status and every rank record written with it) carries its ``seal``: a digest of
the sealer's node id and the ranks it gave, so a member can tell a rank record of the round's
decision from one that another (stale) sealer wrote; and ``fenced``: whether it was written by
a fenced write (``Store.multi_set_if``, in one step with the status, into a round without one).

Values are JSON objects with ``"v": 2`` (version 1 named a joiner's keys by an arrival index);
anything else raises RendezvousStateError naming the key.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import RendezvousStateError

FORMAT_VERSION = 2
ROOT = "rdzv"

# The names under a round's directory, shared by RunKeys (which builds keys) and the parsers
# below (which recognise them, for the etcd backend's one-request steps).
_NODES = "nodes/"
_BACK = "back/"
_RANK = "rank/"
_CTL = "ctl/"
_EXPECT = "expect/"
"""Under ``_CTL``."""
_SEALER = "sealer"
_LEFT = "left/"
_ROUND_DIR = re.compile(rf"{re.escape(ROOT)}/[^/]+/round/[0-9]+/")


@dataclass(frozen=True)
class NodeDescriptor:
    """What a joiner writes about itself: who it is and where rank 0's bootstrap store would be."""

    node_id: str
    host: str
    pid: int
    port: int
    prev_rank: int | None
    joined_at: float | None = None
    """The wall time it joined (for the history's formation time); None from older nodes."""
    order: int | None = None
    """Its place among the newcomers of a round (the ``node_order`` option), if it has one."""


@dataclass(frozen=True)
class Decision:
    """The outcome of a round: its size, rank 0's bootstrap store address, and its identity."""

    world_size: int
    master_addr: str
    master_port: int
    seal: str = ""
    """:func:`seal_of` the decision (empty in records of rdzv versions before fencing)."""
    fenced: bool = False
    """Written by a fenced write: its records and status in one step, into a round without a
    status (so never rewritten); False for a store that cannot fence its writes."""


def seal_of(sealer: str, ranks: Mapping[str, int], master_addr: str, master_port: int) -> str:
    """A decision's identity: a digest of who sealed it and what it decided."""
    canonical = json.dumps([sealer, sorted(ranks.items()), master_addr, master_port])
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class RunKeys:
    """The key names of one run (see the module docstring)."""

    def __init__(self, run_id: str) -> None:
        if not run_id or "/" in run_id or any(ch.isspace() for ch in run_id):
            raise ValueError(
                f"run_id {run_id!r} must be non-empty without '/' or whitespace, e.g. 'job-42'"
            )
        self.run_id = run_id
        self.base = f"{ROOT}/{run_id}/"
        self.closed = self.base + "closed"
        self.sealed = self.base + "sealed"

    def round(self, r: int) -> str:
        return f"{self.base}round/{r}/"

    def nodes(self, r: int) -> str:
        return self.round(r) + _NODES

    def node(self, r: int, node_id: str) -> str:
        return self.nodes(r) + node_id

    def back_dir(self, r: int) -> str:
        return self.round(r) + _BACK

    def back(self, r: int, node_id: str) -> str:
        return self.back_dir(r) + node_id

    def rank(self, r: int, node_id: str) -> str:
        return self.round(r) + _RANK + node_id

    def ctl(self, r: int) -> str:
        return self.round(r) + _CTL

    def status(self, r: int) -> str:
        return self.ctl(r) + "status"

    def armed(self, r: int) -> str:
        return self.ctl(r) + "armed"

    def sealer(self, r: int) -> str:
        return self.round(r) + _SEALER

    def expect_dir(self, r: int) -> str:
        return self.ctl(r) + _EXPECT

    def expect(self, r: int, node_id: str) -> str:
        return self.expect_dir(r) + node_id

    def left_dir(self, r: int) -> str:
        return self.round(r) + _LEFT

    def left(self, r: int, node_id: str) -> str:
        return self.left_dir(r) + node_id

    def user(self, r: int) -> str:
        """The PrefixStore prefix of round ``r``'s members' own keys (no trailing slash)."""
        return self.round(r) + "user"


def _split_round_key(key: str) -> tuple[str, str] | None:
    """``(round directory, rest)`` of a key under any run's round, else None."""
    match = _ROUND_DIR.match(key)
    return (match.group(), key[match.end():]) if match else None


@dataclass(frozen=True)
class JoinerKey:
    """One of a joiner's ephemeral keys, parsed: its descriptor, its "back" mark or its
    liveness for the next round (``expect``)."""

    round_dir: str
    kind: str
    """``"nodes"``, ``"back"`` or ``"expect"``."""
    node_id: str

    @property
    def rank_key(self) -> str:
        """The key the sealer of ``round_dir`` writes this joiner's rank to (for a descriptor,
        ``kind == "nodes"``, the rank of the round it joins)."""
        return self.round_dir + _RANK + self.node_id


def parse_joiner_key(key: str) -> JoinerKey | None:
    """The joiner key ``key`` is (:meth:`RunKeys.node`, ``back``, ``expect``), else None."""
    split = _split_round_key(key)
    if split is None:
        return None
    round_dir, rest = split
    for kind, directory in (("nodes", _NODES), ("back", _BACK), ("expect", _CTL + _EXPECT)):
        if rest.startswith(directory):
            node_id = rest[len(directory):]
            return JoinerKey(round_dir, kind, node_id) if node_id and "/" not in node_id else None
    return None


def is_sealer_lock(key: str) -> bool:
    """Whether ``key`` is a round's sealer lock (:meth:`RunKeys.sealer`)."""
    split = _split_round_key(key)
    return split is not None and split[1] == _SEALER


def control_dir_round(path: str) -> str | None:
    """The round directory of ``path`` if it is a round's control directory
    (:meth:`RunKeys.ctl`, what waiting joiners watch), else None."""
    split = _split_round_key(path)
    return split[0] if split is not None and split[1] == _CTL else None


_COMPACT = json.JSONEncoder(separators=(",", ":"))
_COMPACT_FINITE = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def compact_json(value: Any, *, finite: bool = False) -> bytes:
    """``value`` as JSON without spaces (``finite``: ValueError for NaN or infinity), through
    encoders made once: ``json.dumps`` with options builds a new encoder at every call, which
    doubled the cost of the records every node writes and reads in every round."""
    return (_COMPACT_FINITE if finite else _COMPACT).encode(value).encode()


def _dump(payload: dict[str, Any]) -> bytes:
    return compact_json({"v": FORMAT_VERSION, **payload})


def _load(key: str, raw: bytes, kind: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RendezvousStateError(
            f"rendezvous key {key!r} does not hold rdzv JSON ({raw[:40]!r}); another program "
            "may be using the same store and run id: choose another run_id"
        ) from None
    if not isinstance(data, dict) or data.get("v") != FORMAT_VERSION or data.get("t") != kind:
        raise RendezvousStateError(
            f"rendezvous key {key!r} holds {str(data)[:60]!r}, not a version {FORMAT_VERSION} "
            f"'{kind}' record; nodes of another rdzv version or program share this run id"
        )
    return data


def _field(key: str, data: dict[str, Any], name: str, kind: type, optional: bool = False) -> Any:
    value = data.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RendezvousStateError(
            f"rendezvous key {key!r}: field {name!r} must be {kind.__name__}, got {value!r}"
        )
    return value


def encode_node(node: NodeDescriptor) -> bytes:
    return _dump({"t": "node", "id": node.node_id, "host": node.host, "pid": node.pid,
                  "port": node.port, "prev": node.prev_rank, "at": node.joined_at,
                  "order": node.order})


def decode_node(key: str, raw: bytes) -> NodeDescriptor:
    data = _load(key, raw, "node")
    return NodeDescriptor(
        node_id=_field(key, data, "id", str),
        host=_field(key, data, "host", str),
        pid=_field(key, data, "pid", int),
        port=_field(key, data, "port", int),
        prev_rank=_field(key, data, "prev", int, optional=True),
        joined_at=_field(key, data, "at", float, optional=True),
        order=_field(key, data, "order", int, optional=True),
    )


def encode_decision(decision: Decision) -> bytes:
    return _dump({"t": "sealed", "world_size": decision.world_size,
                  "addr": decision.master_addr, "port": decision.master_port,
                  "seal": decision.seal, "fenced": decision.fenced})


CLOSED_STATUS = _dump({"t": "closed"})


def encode_ranks(ranks: Mapping[str, int], decision: Decision) -> dict[str, bytes]:
    """Each member's rank key: its rank with the decision, so one read tells a member
    everything. The records differ only in the rank: the rest is encoded once."""
    head = _dump({"t": "rank"})[:-1] + b',"rank":'
    tail = _dump({"world_size": decision.world_size, "addr": decision.master_addr,
                  "port": decision.master_port, "seal": decision.seal,
                  "fenced": decision.fenced})[len(_dump({})) - 1:]
    return {node_id: b"%s%d%s" % (head, rank, tail) for node_id, rank in ranks.items()}


def decode_rank(key: str, raw: bytes) -> tuple[int, Decision]:
    data = _load(key, raw, "rank")
    decision = _decision(key, data)
    rank = _field(key, data, "rank", int)
    if not 0 <= rank < decision.world_size:
        raise RendezvousStateError(
            f"rendezvous key {key!r}: rank {rank} outside 0..{decision.world_size - 1}"
        )
    return rank, decision


def _decision(key: str, data: dict[str, Any]) -> Decision:
    world_size = _field(key, data, "world_size", int)
    if world_size < 1:
        raise RendezvousStateError(f"rendezvous key {key!r}: world_size {world_size} < 1")
    return Decision(world_size, _field(key, data, "addr", str), _field(key, data, "port", int),
                    _field(key, data, "seal", str, optional=True) or "",
                    data.get("fenced") is True)


def decode_status(key: str, raw: bytes | None) -> Decision | None | bool:
    """A round's status: None (forming), a Decision (sealed) or True (closed)."""
    if raw is None:
        return None
    if raw == CLOSED_STATUS:
        return True
    return _decision(key, _load(key, raw, "sealed"))


def decode_int(key: str, raw: bytes | None, default: int) -> int:
    """An integer key (a counter, a rank, a round number), validated."""
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise RendezvousStateError(
            f"rendezvous key {key!r} must hold an integer, got {raw[:40]!r}"
        ) from None


# -- the agents' keys, in each round's own store (``round/<r>/user/``, RendezvousInfo.store) -----
AGENT_DIR = "agent/"
"""Every key the agents (``rdzv run``) keep in a round's store."""
AGENT_NODES = AGENT_DIR + "node/"
"""Each agent's record by group rank (``rdzv status`` reads host, pid and workers from it)."""
AGENT_READY = AGENT_DIR + "ready/"
"""A key per node whose record is final: the coordinator counts them (one O(1) call)."""
AGENT_RESTARTING = AGENT_DIR + "restart/"
"""A key per node whose final record asks every worker to restart: the coordinator then decides
once every record is written, final or not (a restart stops every worker anyway; workers still
starting in a group that cannot form would keep their record from ever being final)."""
AGENT_ALIVE = AGENT_DIR + "alive/"
"""Each agent's ephemeral sign of life: the wall time it last wrote it."""
AGENT_SEEN = AGENT_DIR + "seen/"
"""The same sign of life as :data:`AGENT_ALIVE` but lasting: when a node's alive entry vanishes,
how long it had been silent tells a lost connection from missed heartbeats (the history)."""
AGENT_LEAVING = AGENT_DIR + "leaving/"
"""A node leaving gracefully writes its group rank here before it withdraws from the next round."""
AGENT_DONE = AGENT_DIR + "done/"
"""A node whose workers finished the job says so here, as does one with no worker in the job's
group (its workers start to join it): the nodes that finished wait for every other one."""
AGENT_STRAGGLERS = AGENT_DIR + "straggler/"
"""Group rank 0 flags a straggler here: its group rank -> the ratio of its work to the others'."""
AGENT_EVICT = AGENT_DIR + "evict/"
"""Group rank 0 asks a node (its group rank) to leave for a spare here; the node reads it."""
AGENT_CTL = AGENT_DIR + "ctl/"
"""What every node of the round watches: the decision, the hint, abandon marks (O(1) wake-ups)."""
AGENT_DECISION = AGENT_CTL + "decision"
"""The coordinator's one decision for the round (in-process switch, restart, ...)."""
AGENT_HINT = AGENT_CTL + "hint"
"""Group rank 0's word, as soon as it knows, whether the job runs in-process (a newcomer then
starts its workers at once, warm, before the decision)."""
AGENT_ABANDON = AGENT_CTL + "abandon/"
"""A node that left the round after its decision (a participant lost meanwhile) says so here."""
AGENT_ASSIGN = AGENT_DIR + "assign/"
"""``<decision id>/<group rank>``: each node's place in the round the decision starts."""
AGENT_NEXT = AGENT_DIR + "next"
"""How the round's members moved on (for a node that leaves it): the next round's kind and
switch step, written by the next round's coordinator."""


def assign_key(decision_id: str, group_rank: int) -> str:
    return f"{AGENT_ASSIGN}{decision_id}/{group_rank}"


def abandon_key(group_rank: int) -> str:
    return f"{AGENT_ABANDON}{group_rank}"


def record_key(group_rank: int) -> str:
    return f"{AGENT_NODES}{group_rank}"


def ready_key(group_rank: int) -> str:
    return f"{AGENT_READY}{group_rank}"


def restarting_key(group_rank: int) -> str:
    return f"{AGENT_RESTARTING}{group_rank}"
