"""The rendezvous rules as pure functions: what a node does next, who gets which rank.

Nothing here does I/O or reads a clock: the executor (``_engine.py``) observes the store, passes
a :class:`RoundView` and its monotonic clock value, and carries out the returned :class:`Step`.

Rules of a forming round r (torch's documented semantics, plus the re-rendezvous fast path):

* The round is **open** once a member of round r-1 has come back (``rejoined > 0``) or round
  r-1 has no alive member left (``expected == 0``; always true for the first round). Until then
  newcomers wait: a running group is never split into two groups of the same run.
* It **seals at once** when ``alive >= max_nodes``, or when every alive member of round r-1 has
  come back and ``alive >= min_nodes`` (the expected set is known: no last call is needed).
* Otherwise, once ``alive >= min_nodes`` the round is **armed** and seals when
  ``last_call_timeout`` has passed on the observing node's own clock since it saw it armed.
* Past the join deadline the node gives up (RendezvousTimeoutError), except a **spare**: a
  node waiting while the running round is full (``max_nodes`` members, all alive, none coming
  back) waits without a deadline, costs the running group nothing (members ignore newcomers that
  cannot fit, :func:`membership_changed`), and joins the round after a member leaves or is lost.

Rank rule (:func:`plan_ranks`): newcomers are ordered by their ``node_order`` where they have
one (under Slurm, the node's index in the job step), the others after them; then by host, pid and
node id (as torch orders its node descriptors: nodes of one host get neighbouring ranks). With more than ``max_nodes``
joiners, previous members are chosen first, then newcomers in that order. A previous member keeps
its rank if it is below the new world size; the free ranks are given, lowest first, to the other
previous members in the order of their old ranks, then to the newcomers in their order.

Accepting a rank (:func:`check_rank`): a node takes the rank its record gives only if the record
belongs to the decision in the round's status (the same ``seal``). The sealer writes both in one
fenced write, so they differ only if a sealer wrote without the lock (a store that cannot fence
its writes): a record of another decision than the status's is not this round's, and the node
is late for it; a record without a status yet means the decision is still being written. (A
record that says a fenced write made it is its round's status: the engine takes it as such
without reading the status.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

from ._layout import Decision, NodeDescriptor


@dataclass(frozen=True)
class RoundView:
    """What one node observed of its forming round (all counts from O(1) store calls)."""

    closed: bool
    """The run is closed (``closed`` key or a ``closed`` round status)."""
    sealed: bool
    """The round has a decision."""
    alive: int
    """Joiners of this round whose ephemeral descriptor still exists."""
    rejoined: int
    """Alive joiners that were members of the previous round."""
    expected: int
    """Alive joiners of the previous round (members, and late ones not yet moved on)."""
    armed: bool
    """Someone saw the round open with ``alive >= min_nodes``."""


@dataclass(frozen=True)
class RoundRules:
    """The parameters of the barrier."""

    min_nodes: int
    max_nodes: int
    last_call_timeout: float


class Action(enum.Enum):
    WAIT = "wait"
    """Wait for a change of the round's control keys, until ``Step.wake_at`` at the latest."""
    ARM = "arm"
    """Mark the round armed (written once), then observe again."""
    SEAL = "seal"
    """Try to take the sealer lock, list the joiners and write the decision."""
    COLLECT = "collect"
    """The round is sealed: read this node's rank (none: it is late for this round)."""
    CLOSED = "closed"
    """The rendezvous is closed: raise RendezvousClosedError."""
    TIMEOUT = "timeout"
    """The join deadline passed: raise RendezvousTimeoutError."""


@dataclass(frozen=True)
class Step:
    action: Action
    wake_at: float = 0.0
    armed_since: float | None = None
    """When this node first saw the round armed (its last-call timer start), to pass back in."""


def is_open(view: RoundView) -> bool:
    return view.rejoined > 0 or view.expected == 0


def is_spare(view: RoundView, rules: RoundRules) -> bool:
    """Whether a node waiting in this round is a spare: the running round is full and stays."""
    return not view.closed and not view.sealed and not is_open(view) and (
        view.expected >= rules.max_nodes)


def join_deadline(view: RoundView, rules: RoundRules, now: float, deadline: float,
                  join_timeout: float) -> float:
    """The join deadline after this observation: a spare's starts again from now."""
    return max(deadline, now + join_timeout) if is_spare(view, rules) else deadline


def decide(
    view: RoundView, rules: RoundRules, now: float, deadline: float, armed_since: float | None
) -> Step:
    """The next step of a node waiting in a forming round, given its view and clock."""
    if view.closed:
        return Step(Action.CLOSED)
    if view.sealed:
        return Step(Action.COLLECT)
    open_ = is_open(view)
    if open_ and view.alive >= rules.max_nodes:
        return Step(Action.SEAL, armed_since=armed_since)
    if open_ and 0 < view.expected <= view.rejoined and view.alive >= rules.min_nodes:
        return Step(Action.SEAL, armed_since=armed_since)
    if now >= deadline:
        return Step(Action.TIMEOUT)
    if not (open_ and view.alive >= rules.min_nodes):
        return Step(Action.WAIT, wake_at=deadline, armed_since=armed_since)
    if not view.armed:
        return Step(Action.ARM, armed_since=armed_since)
    start = now if armed_since is None else armed_since
    last_call_end = start + rules.last_call_timeout
    if now >= last_call_end:
        return Step(Action.SEAL, armed_since=start)
    return Step(Action.WAIT, wake_at=min(deadline, last_call_end), armed_since=start)


def join_timeout_message(view: RoundView, rules: RoundRules, r: int, run_id: str,
                         join_timeout: float) -> str:
    """What a node that gave up waiting for round r to form is told (:attr:`Action.TIMEOUT`)."""
    back = "" if view.expected == 0 else (
        f", {view.rejoined} of {view.expected} previous members back")
    return (f"round {r} of run {run_id!r} did not form within join_timeout={join_timeout:g} s: "
            f"{view.alive} node(s) alive, min_nodes={rules.min_nodes}{back}")


def plan_ranks(joiners: Mapping[str, NodeDescriptor], rules: RoundRules) -> dict[str, int] | None:
    """Node id -> rank for the members of the round, or None if fewer than min_nodes."""
    if len(joiners) < rules.min_nodes:
        return None
    previous = sorted(
        (node for node in joiners.values() if node.prev_rank is not None),
        key=lambda node: (node.prev_rank, node.node_id),
    )
    newcomers = sorted(
        (node for node in joiners.values() if node.prev_rank is None),
        key=lambda node: (node.order is None, node.order or 0, node.host, node.pid, node.node_id),
    )
    chosen = (previous + newcomers)[: rules.max_nodes]
    world_size = len(chosen)
    ranks: dict[str, int] = {}
    taken: set[int] = set()
    for node in chosen:
        rank = node.prev_rank
        if rank is not None and rank < world_size and rank not in taken:
            ranks[node.node_id] = rank
            taken.add(rank)
    free = iter(sorted(set(range(world_size)) - taken))
    for node in chosen:
        if node.node_id not in ranks:
            ranks[node.node_id] = next(free)
    return ranks


def membership_changed(closed: bool, waiting: int, rejoined: int, alive_members: int,
                       world_size: int, max_nodes: int, newer_round_sealed: bool) -> bool:
    """Whether a member of a completed round should re-rendezvous.

    ``waiting`` counts the joiners of the next round (newcomers and members already coming
    back), ``rejoined`` the members among them; ``alive_members`` the alive members of the round
    (a lost or leaving one lowers it). Newcomers count only if the round has room for them: a
    full round ignores its spares until a member leaves or is lost.
    """
    newcomers = waiting - rejoined
    return (
        closed
        or newer_round_sealed
        or rejoined > 0
        or alive_members < world_size
        or (newcomers > 0 and world_size < max_nodes)
    )


def nodes_waiting(waiting: int, rejoined: int, alive_members: int, max_nodes: int) -> int:
    """What ``num_nodes_waiting()`` reports to a member: the joiners that would change its round
    (members coming back, and newcomers while the round has room: fewer than ``max_nodes`` of
    its members alive); spares do not count, as in torch's c10d backend, whose agent restarts
    its workers whenever the count is positive.

    Room is counted from the members alive, not from the round's size: a lost member's place is
    free, and the node waiting for it is no spare (:func:`is_spare` sees the same count), as
    c10d moves a node from its redundancy list to its wait list once a participant is dead."""
    return rejoined + (waiting - rejoined if alive_members < max_nodes else 0)


def members_lost(alive_members: int, world_size: int) -> int:
    """How many members of a completed round of ``world_size`` nodes are gone (died, hung past
    their session ttl, or left), ``alive_members`` of them being alive in the next round. A
    late joiner of the round that has not moved on yet can count as alive for a moment: never
    below 0."""
    return max(0, world_size - alive_members)


class Verdict(enum.Enum):
    ACCEPT = "accept"
    """The record is the round's decision: take its rank."""
    LATE = "late"
    """No record, or one of another decision than the status's: not a member of this round."""
    UNSEALED = "unsealed"
    """No status yet: the decision is still being written; wait for it."""
    CLOSED = "closed"
    """The round's status says closed: the rendezvous is closed."""


def check_rank(record: Decision | None, status: Decision | bool | None) -> Verdict:
    """Whether a node may accept the rank ``record`` (its decision; None: no record) given
    the round's ``status`` (a Decision, True if closed, None if absent)."""
    if status is True:
        return Verdict.CLOSED
    if status is None or status is False:
        return Verdict.UNSEALED
    return Verdict.ACCEPT if record == status else Verdict.LATE
