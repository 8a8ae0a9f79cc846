"""The messages between an agent and its workers, as typed values (the channel carries them as
JSON lines, :mod:`._channel`).

agent -> worker:
    :class:`Plan`   the decision of a round, for this worker: how its group changes (``kind``),
                    its place in the new group and the step at which it moves.
    :class:`Abort`  a member of the worker's group is gone: abort the group now (a collective
                    waiting on the lost peer fails instead of waiting for the group's timeout).
    :class:`Stop`   the agent stops its workers: exit now (the agent's SIGTERM follows).
    :class:`Probe`  the worker made no progress for a while: say where its training thread is.
worker -> agent:
    :class:`Hello`     connected: ``fresh`` when the worker holds no training state yet (it was
                       started to join a running group).
    :class:`Progress`  completed ``step``, the recent ``step_time`` and how it splits into
                       ``compute`` and ``wait`` for the others (``rdzv.torch._steptime``).
    :class:`Where`     the answer to a Probe: whether the training thread waits for its peers
                       (in a collective) or is in its own code, and where.
    :class:`Broken`    its group failed at ``step``; it waits for the next plan.
    :class:`Entered`   it is in the group of round ``round`` (``ms``: its pause).
    :class:`Left`      it left the job at ``step`` (its node leaves).
    :class:`Failed`    it cannot follow the plan (not a group failure); it exits.
    :class:`Term`      it received SIGTERM: the node's notice to leave.
    :class:`Closed`    (made by the agent's channel) the worker's connection ended.

Every message has a ``type`` tag and typed fields; :func:`decode` checks both, so a malformed
line is a :class:`ChannelError` naming what is wrong, never a KeyError later.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from .errors import RendezvousError


PROGRESS_EVERY = 0.5
"""Seconds between a worker's :class:`Progress` reports while it trains."""


class ChannelError(RendezvousError):
    """A message on the agent-worker channel is malformed or the channel is gone."""


class PlanKind(enum.Enum):
    """How a worker's group changes in a round (the agents' decision, see ``agent/_decide.py``)."""

    SWITCH = "switch"
    """A planned change: at the end of step ``step`` the worker moves to the new group."""
    RECOVER = "recover"
    """A member was lost: the worker moves to the new group at once (its group is broken)."""
    LEAVE = "leave"
    """This worker's node leaves: the worker stops at the end of step ``step``."""


@dataclass(frozen=True)
class Plan:
    round: int
    """The transition's number as the worker's agent counts its rounds (it names the group in
    :class:`Broken` and :class:`Entered`), not the rendezvous' round number."""
    kind: PlanKind
    step: int | None = None
    """SWITCH/LEAVE: the step at whose end the worker moves; RECOVER: the step adopted."""
    source: int | None = None
    """The global rank (new group) whose state the others adopt (None: nobody holds one)."""
    rank: int = 0
    world_size: int = 0
    group_rank: int = 0
    group_world_size: int = 0
    role_rank: int = 0
    role_world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    prefix: str = ""
    """The new group's key prefix in its store (a fresh one per group)."""
    TYPE: ClassVar[str] = "plan"


@dataclass(frozen=True)
class Abort:
    TYPE: ClassVar[str] = "abort"


@dataclass(frozen=True)
class Stop:
    TYPE: ClassVar[str] = "stop"


@dataclass(frozen=True)
class Probe:
    TYPE: ClassVar[str] = "probe"


@dataclass(frozen=True)
class Hello:
    local_rank: int
    pid: int
    fresh: bool = False
    TYPE: ClassVar[str] = "hello"


@dataclass(frozen=True)
class Progress:
    step: int
    step_time: float | None = None
    compute: float | None = None
    """Seconds per step in the worker's own code (the recent steps' mean; None: unknown)."""
    wait: float | None = None
    """Seconds per step waiting for the other ranks (the gradients' reduction)."""
    TYPE: ClassVar[str] = "progress"


@dataclass(frozen=True)
class Where:
    step: int
    waiting: bool
    """The training thread waits for its peers (in a collective), not in its own code."""
    frame: str = ""
    """Its innermost frame of the training script or library, as ``file:line in function``."""
    stuck: bool = False
    """It has waited for its peers since its agent's last abort, without computing: in a
    collective call, or in the gradients' reduction with no gradient since (the aborted
    group's collective did not wake; see ``rdzv.torch._steptime.stuck``)."""
    TYPE: ClassVar[str] = "where"


@dataclass(frozen=True)
class Broken:
    step: int
    fresh: bool = False
    """It holds no training state (a joiner whose first group failed)."""
    round: int | None = None
    """The round of the group that failed while the worker entered it (None: the group it
    trained in failed)."""
    error: str = ""
    TYPE: ClassVar[str] = "broken"


@dataclass(frozen=True)
class Entered:
    round: int
    ms: float
    step: int
    received: bool = False
    create_ms: float = 0.0
    """Of ``ms``: until the new group was created (a recovery: waiting for the plan too)."""
    agree_ms: float = 0.0
    """Of ``ms``: the agreement on the state, and its transfer (the rest: the callbacks)."""
    TYPE: ClassVar[str] = "entered"


@dataclass(frozen=True)
class Moving:
    """The training thread took the plan of ``round``: it is out of its old group's
    collectives, an aborted group's too (its agent stops counting it as possibly stuck there,
    ``agent/_moves.abort_due``)."""

    round: int
    TYPE: ClassVar[str] = "moving"


@dataclass(frozen=True)
class Left:
    step: int
    TYPE: ClassVar[str] = "left"


@dataclass(frozen=True)
class Failed:
    error: str
    misfit: bool = False
    """The worker cannot hold the job's state (its model or optimizer is not the job's)."""
    TYPE: ClassVar[str] = "failed"


@dataclass(frozen=True)
class Term:
    TYPE: ClassVar[str] = "term"


@dataclass(frozen=True)
class Shards:
    """The worker's model is sharded among its node's workers (``rdzv.torch.node_mesh``): none
    of them holds a whole state alone, so they restart together."""

    TYPE: ClassVar[str] = "shards"


@dataclass(frozen=True)
class Closed:
    TYPE: ClassVar[str] = "closed"


ToWorker = Union[Plan, Abort, Stop, Probe]
ToAgent = Union[Hello, Progress, Where, Broken, Moving, Entered, Left, Failed, Term, Shards]
TO_WORKER: dict[str, type] = {cls.TYPE: cls for cls in (Plan, Abort, Stop, Probe)}
TO_AGENT: dict[str, type] = {cls.TYPE: cls for cls in (Hello, Progress, Where, Broken, Moving,
                                                      Entered, Left, Failed, Term, Shards)}
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "int | None": (int, type(None)), "float": (int, float),
    "float | None": (int, float, type(None)), "str": (str,), "bool": (bool,),
}


def encode(message: Any) -> bytes:
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    fields = {k: v.value if isinstance(v, enum.Enum) else v for k, v in fields.items()}
    return json.dumps({"type": message.TYPE, **fields}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes, types: dict[str, type]) -> Any:
    """One line as a message of one of ``types``, or ChannelError saying what is wrong."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ChannelError(f"not JSON on the agent channel: {line[:80]!r}") from exc
    kind = data.get("type") if isinstance(data, dict) else None
    cls = types.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ChannelError(f"unknown message on the agent channel: {line[:80]!r}")
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.name not in data:
            if field.default is dataclasses.MISSING:
                raise ChannelError(f"a {kind!r} message without {field.name!r}: "
                                   f"{line[:80]!r}")
            continue
        value = data[field.name]
        if field.type == "PlanKind":
            try:
                value = PlanKind(value)
            except ValueError:
                raise ChannelError(f"unknown plan kind {value!r} on the agent channel") from None
        elif not isinstance(value, _FIELD_TYPES[str(field.type)]) or (
                isinstance(value, bool) and str(field.type).startswith(("int", "float"))):
            raise ChannelError(f"field {field.name!r} of a {kind!r} message is "
                               f"{value!r}, not {field.type}")
        values[field.name] = value
    return cls(**values)
