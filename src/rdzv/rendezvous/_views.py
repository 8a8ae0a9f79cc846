"""What a node reads of its run to decide: the round forming now, and whether its own round's
membership changed. Each is one :meth:`Store.read_many` (one round trip on TCPStore, one
transaction on etcd) turned into the inputs of the pure rules of ``_decisions.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..store import Store
from ._decisions import RoundRules, RoundView, members_lost, membership_changed, nodes_waiting
from ._layout import RunKeys, decode_int, decode_status


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


def observe_changes(
    store: Store, keys: RunKeys, rules: RoundRules, member: Membership
) -> RoundChanges:
    """The nodes waiting and the members lost of ``member``'s round, from one
    :meth:`Store.read_many`: the joiners, the members coming back and the members alive, all
    counted in the next round."""
    next_round = member.round + 1
    nodes, back_dir, expect_dir = (keys.nodes(next_round), keys.back_dir(next_round),
                                   keys.expect_dir(next_round))
    counts = store.read_many([], [nodes, back_dir, expect_dir]).counts
    alive = counts[expect_dir]
    return RoundChanges(nodes_waiting(counts[nodes], counts[back_dir], alive, rules.max_nodes),
                        members_lost(alive, member.world_size))


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


def membership_change(
    store: Store, keys: RunKeys, rules: RoundRules, member: Membership, path: str
) -> tuple[bool, int]:
    """Whether a member should re-rendezvous, and the revision of ``path`` to watch from,
    from one :meth:`Store.read_many`."""
    next_round = member.round + 1
    status, nodes, expect_dir, back_dir = (
        keys.status(next_round), keys.nodes(next_round), keys.expect_dir(next_round),
        keys.back_dir(next_round),
    )
    reads = store.read_many(
        [status, keys.closed, keys.sealed], [nodes, expect_dir, back_dir], revisions=[path]
    )
    latest_sealed = decode_int(keys.sealed, reads.values[keys.sealed], -1)
    return membership_changed(
        closed=reads.values[status] is not None or reads.values[keys.closed] is not None,
        waiting=reads.counts[nodes],
        rejoined=reads.counts[back_dir],
        alive_members=reads.counts[expect_dir],
        world_size=member.world_size,
        max_nodes=rules.max_nodes,
        newer_round_sealed=latest_sealed > member.round,
    ), reads.revisions[path]
