"""What a node reads of its run to decide: the round forming now, and whether its own round's
membership changed. Each is one :meth:`Store.read_many` (one round trip on TCPStore, one
transaction on etcd) turned into the inputs of the pure rules of ``_decisions.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..store import Store
from ._decisions import (
    RoundRules,
    RoundView,
    members_lost,
    membership_changed,
    nodes_waiting,
)
from ._layout import Decision, RunKeys, decode_int, decode_rank, decode_status


@dataclass(frozen=True)
class Membership:
    """This node's place in the last round it completed."""

    round: int
    rank: int
    world_size: int
    rejoined: bool


@dataclass(frozen=True)
class RoundChanges:
    """What a member sees of its round's membership, read at once."""

    waiting: int
    """Joiners of the next round that would change this one (``num_nodes_waiting()``)."""
    lost: int
    """Members of this round no longer alive (died, hung past their session ttl, or left)."""


def store_wait(store: Store, seconds: float) -> float:
    """``seconds``, at least 0 and at most one timeout of ``store`` (a blocking call's bound)."""
    return max(0.0, min(seconds, store.timeout.total_seconds()))


def latest_sealed(store: Store, keys: RunKeys) -> int:
    """The number of the run's last sealed round (-1: none yet)."""
    return decode_int(keys.sealed, store.try_get(keys.sealed), -1)


def observe_round(store: Store, keys: RunKeys, rules: RoundRules, r: int) -> tuple[RoundView, int]:
    """The round as seen now and the revision of its ``ctl/`` to watch from, in one
    :meth:`Store.read_many` (one round trip on TCPStore, one transaction on etcd). Reads what
    the decision can need and nothing more: the armed flag only if ``min_nodes <
    max_nodes``, the previous round's members only for r > 0."""
    status_key, armed_key = keys.status(r), keys.armed(r)
    nodes, expect_dir, back_dir = keys.nodes(r), keys.expect_dir(r), keys.back_dir(r)
    ctl = keys.ctl(r)
    may_arm = rules.min_nodes < rules.max_nodes
    reads = store.read_many(
        keys=[status_key, armed_key] if may_arm else [status_key],
        counts=[nodes, expect_dir, back_dir] if r > 0 else [nodes],
        revisions=[ctl],
    )
    seen = reads.revisions[ctl]
    status = decode_status(status_key, reads.values[status_key])
    if status is not None:
        return RoundView(status is True, status is not True, 0, 0, 0, False), seen
    alive = reads.counts[nodes]
    expected = reads.counts.get(expect_dir, 0)
    armed = rules.min_nodes <= alive < rules.max_nodes and reads.values[armed_key] is not None
    rejoined = reads.counts[back_dir] if expected else 0
    return RoundView(False, False, alive, rejoined, expected, armed), seen


@dataclass(frozen=True)
class MembershipView:
    """What a member sees of its round's membership now (the counts of one read)."""

    round: int
    world_size: int
    alive: int
    """Members whose liveness for the next round still exists (a lost member's is gone, and a
    member announcing its leave withdraws it)."""
    waiting: int
    """Joiners of the next round: newcomers and members already moving on."""
    moved: int
    """Members already in the next round."""
    closed: bool
    newer_round_sealed: bool
    max_nodes: int

    @property
    def nodes_waiting(self) -> int:
        """What ``num_nodes_waiting()`` reports: the members moving on, and the newcomers that
        fit (a full round ignores its spares; a lost member's place is free)."""
        return nodes_waiting(self.waiting, self.moved, self.alive, self.max_nodes)

    @property
    def newcomers(self) -> int:
        """Waiting newcomers that fit."""
        return self.nodes_waiting - self.moved

    @property
    def lost(self) -> int:
        """Members gone (died, hung past their session ttl, or left)."""
        return members_lost(self.alive, self.world_size)

    @property
    def changed(self) -> bool:
        """Whether the member should re-rendezvous."""
        return membership_changed(self.closed, self.waiting, self.moved, self.alive,
                                  self.world_size, self.max_nodes, self.newer_round_sealed)


def membership_view(
    store: Store, keys: RunKeys, rules: RoundRules, member: Membership, path: str
) -> tuple[MembershipView, int]:
    """The member's view of its round, and the revision of ``path`` to watch from, from one
    :meth:`Store.read_many`."""
    next_round = member.round + 1
    status, nodes, expect_dir, back_dir = (
        keys.status(next_round), keys.nodes(next_round), keys.expect_dir(next_round),
        keys.back_dir(next_round),
    )
    reads = store.read_many(
        [status, keys.closed, keys.sealed], [nodes, expect_dir, back_dir], revisions=[path]
    )
    latest_sealed = decode_int(keys.sealed, reads.values[keys.sealed], -1)
    return MembershipView(
        round=member.round,
        world_size=member.world_size,
        alive=reads.counts[expect_dir],
        waiting=reads.counts[nodes],
        moved=reads.counts[back_dir],
        closed=reads.values[status] is not None or reads.values[keys.closed] is not None,
        newer_round_sealed=latest_sealed > member.round,
        max_nodes=rules.max_nodes,
    ), reads.revisions[path]


def read_outcome(store: Store, keys: RunKeys, r: int, rank_key: str, raw: bytes | None,
                 raw_status: bytes | None, status_read: bool
                 ) -> tuple[int, Decision | None, Decision | bool | None]:
    """A node's rank record of round ``r`` (its raw value) decoded, with the round's status:
    (rank, the decision the record belongs to, the round's status). The status comes with the
    record (``status_read``), or is read here, except for a record of a fenced write: written
    in one step with the status, into a round without one, it is the round's status."""
    rank, decision = decode_rank(rank_key, raw) if raw is not None else (-1, None)
    if decision is not None and decision.fenced and not status_read:
        return rank, decision, decision
    if not status_read:
        raw_status = store.try_get(keys.status(r))
    return rank, decision, decode_status(keys.status(r), raw_status)
