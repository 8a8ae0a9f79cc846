"""The facts of the history, as pure functions of what a node observed: what a new round
changed (members, newcomers, who left and why, its cause) and why a lost member was lost.

No I/O here: the sealer (``_engine.py``) and the agent (``agent/_history.py``) gather the
observations (in reads they make anyway, for the sealer) and write the events.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping, Sequence

from ..errors import RendezvousStateError
from ..store import Reads
from ._history import (
    LEAVE_REASONS,
    RunEvent,
    decode_event,
    encode_event,
    new_event,
    round_event_key,
)
from ._history_bounds import MAX_EVENT_BYTES, MAX_LIST
from ._layout import NodeDescriptor, RunKeys, compact_json

logger = logging.getLogger(__name__)

_MARK_REASONS = frozenset(LEAVE_REASONS) - {"closed"}


def encode_left_mark(reason: str, **details: Any) -> bytes:
    """The value of a ``round/<r>/left/<id>`` mark: why that member is not coming back."""
    if reason not in _MARK_REASONS:
        raise ValueError(f"unknown leave reason {reason!r}; one of {sorted(_MARK_REASONS)}")
    return compact_json({"reason": reason, **details})


def decode_left_mark(raw: bytes) -> str:
    """The reason in a leave mark; ``lost`` for anything unreadable (it is only a hint)."""
    try:
        reason = json.loads(raw).get("reason")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return "lost"
    return reason if reason in _MARK_REASONS else "lost"


def why_left(node: str, marks: Mapping[str, str], closed: bool) -> str:
    """Why member ``node`` of the previous round is not in the new one: what its leave mark
    says (written by the node leaving gracefully, or by a member that saw it lost), else
    ``closed`` if the run is closed, else ``lost`` (its liveness went, the cause unseen)."""
    if node in marks:
        return marks[node]
    return "closed" if closed else "lost"


def why_lost(silent_s: float | None, heartbeat_s: float, session_ttl_s: float) -> str:
    """Why a member whose liveness vanished was lost, from how long it had been silent (since
    its last sign of life) when it vanished: at once (its connection or process ended:
    ``connection_lost``), or after its store session's ttl (it stopped heartbeating while its
    connection stayed: a hung or frozen process, a cut network: ``heartbeat_missed``).
    ``lost`` when the silence does not tell (unknown, or between the two)."""
    if silent_s is None or silent_s < 0:
        return "lost"
    if silent_s >= 0.9 * session_ttl_s:
        return "heartbeat_missed"
    if silent_s <= heartbeat_s * 1.5 + 1.0 and silent_s < 0.9 * session_ttl_s:
        return "connection_lost"
    return "lost"


def round_cause(r: int, previous_known: bool, newcomers: int, left: Sequence[str]) -> str:
    """What made round ``r`` form: ``initial`` (the first round, or the previous one unknown),
    ``loss`` (a member was lost), ``leave`` (only graceful leaves), ``join`` (only newcomers),
    ``restart`` (the same members again: a worker failed, or the run restarted)."""
    if r == 0 or not previous_known:
        return "initial"
    if any(reason != "graceful_leave" for reason in left):
        return "loss"
    if left:
        return "leave"
    return "join" if newcomers else "restart"


def previous_members(previous: RunEvent | None, r: int) -> list[str] | None:
    """The members of round ``r - 1`` as its event names them all, or None if it does not
    (unknown, another round's, clipped, or malformed: only a list of node ids counts)."""
    if previous is None or previous.round != r - 1 or "members_count" in previous.fields:
        return None
    before = previous.fields.get("members")
    if not isinstance(before, list) or not all(isinstance(node, str) for node in before):
        return None
    return before


def _fit(fields: dict[str, Any], lists: Mapping[str, list[Any]],
         make: Callable[[dict[str, Any]], RunEvent]) -> RunEvent:
    """The event ``make(fields)`` with ``lists`` in its fields, each clipped to
    :data:`MAX_LIST` entries, and to fewer (halving) until its record fits in
    :data:`MAX_EVENT_BYTES`; a clipped list's full length is in ``<name>_count``."""
    keep = MAX_LIST
    while True:
        clipped = dict(fields)
        for name, values in lists.items():
            clipped[name] = values[:keep]
            if len(values) > keep:
                clipped[f"{name}_count"] = len(values)
        event = make(clipped)
        if keep == 0 or len(encode_event(event)) <= MAX_EVENT_BYTES:
            return event
        keep //= 2


def round_formed(
    r: int,
    ranks: Mapping[str, int],
    prev_ranks: Mapping[str, int | None],
    joined_at: Sequence[float],
    previous: RunEvent | None,
    marks: Mapping[str, str],
    closed: bool,
    sealer: str,
) -> RunEvent:
    """The ``round_formed`` event of round ``r``, sealed now by ``sealer`` with ``ranks`` (node
    id -> rank), from the joiners' previous ranks (None: new), their join times, the previous
    round's event (None if unknown: a malformed one counts as unknown) and the leave marks of
    round ``r``."""
    members = sorted(ranks, key=ranks.__getitem__)
    event = new_event("round_formed", round=r, node=sealer)
    before = previous_members(previous, r)
    if before is not None:
        gone = [node for node in before if node not in ranks]
        left = [{"node": node, "reason": why_left(node, marks, closed)} for node in gone]
        newcomers = [node for node in members if node not in before]
    else:
        left = [{"node": node, "reason": reason} for node, reason in marks.items()]
        newcomers = [node for node in members if prev_ranks.get(node) is None]
    reasons = [entry["reason"] for entry in left]
    fields: dict[str, Any] = {"world_size": len(members),
                              "cause": round_cause(r, before is not None, len(newcomers), reasons)}
    if joined_at:
        fields["formation_s"] = round(max(0.0, event.time - min(joined_at)), 6)
    return _fit(fields, {"members": members, "newcomers": newcomers, "left": left},
                lambda clipped: RunEvent(event.seq, event.time, event.kind, r, sealer, clipped))


def round_event(keys: RunKeys, r: int, ranks: Mapping[str, int],
                joiners: Mapping[str, NodeDescriptor], reads: Reads,
                sealer: str) -> tuple[RunEvent, list[str]]:
    """Round r's ``round_formed`` event from what the seal's read brought (the previous round's
    event, round r's leave marks), and the leave marks it consumed (to delete)."""
    previous = None
    raw = reads.values.get(round_event_key(keys, r - 1)) if r > 0 else None
    if raw is not None:
        try:
            previous = decode_event(round_event_key(keys, r - 1), raw)
        except RendezvousStateError as exc:
            logger.warning("history: %s", exc)
    listed = reads.lists.get(keys.left_dir(r), {})
    prefix = len(keys.left_dir(r))
    marks = {key[prefix:]: decode_left_mark(value) for key, value in listed.items()}
    event = round_formed(
        r, ranks, {node_id: node.prev_rank for node_id, node in joiners.items()},
        [node.joined_at for node in joiners.values() if node.joined_at is not None],
        previous, marks, False, sealer,
    )
    return event, list(listed)
