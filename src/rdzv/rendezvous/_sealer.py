"""Sealing a round: the one node that takes a round's sealer lock writes its decision.

The decision (every joiner's rank record, the round's status, the ``sealed`` pointer and the
history's ``round_formed`` event) is one write, fenced on the lock where the store can
(:meth:`Store.multi_set_if`): a sealer that lost its lock while it was paused longer than its
session ttl writes nothing, so a round never gets two decisions. The rules (who gets which
rank) are :func:`plan_ranks`; this module does the I/O of one attempt.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable

from ..errors import RendezvousStateError, StoreError, StoreUnsupportedError
from ..store import Reads, Store
from ._decisions import RoundRules, plan_ranks
from ._history import RunEvent, encode_event, round_event_key
from ._history_facts import round_event
from ._layout import (
    CLOSED_STATUS,
    Decision,
    NodeDescriptor,
    RunKeys,
    decode_node,
    encode_decision,
    encode_ranks,
    seal_of,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SealAttempt:
    """What one attempt to seal a round did."""

    held: bool
    """This node got the sealer lock (False: another node holds it; wait for it)."""
    mine: tuple[bytes, bytes] | None = None
    """This node's rank record and the round's status, if it sealed the round as a member."""
    left_marks: list[str] = field(default_factory=list)
    """The leave marks the decision's history event consumed (garbage once the round forms)."""


class Sealer:
    """Seals the rounds of one run for one node (``node_id``, renamed when its session is lost).

    ``fence``: write decisions fenced on the lock; it turns off, once, on a store server that
    turns out not to offer conditional writes. ``history``: the decision carries the history's
    ``round_formed`` event (no extra round trip).
    """

    def __init__(self, store: Store, keys: RunKeys, rules: RoundRules, node_id: str, *,
                 fence: bool, history: bool) -> None:
        self._store, self._keys, self._rules = store, keys, rules
        self.node_id = node_id
        self._fence = fence
        self._history = history

    def try_seal(self, r: int) -> SealAttempt:
        """Seal round r if this node gets the sealer lock.

        One round trip takes the lock, one reads the status and the joiners (and what the
        history's event needs), one writes the decision (:meth:`_write_decision`: fenced, and
        emptying the lock with it). A sealer fenced off (it lost the lock while paused, or
        ``set_closed`` closed the round first) writes nothing and reads the round's outcome
        like the others. Emptying the lock, or the holder's death, wakes the nodes waiting for
        it (:meth:`wait`).
        """
        store, keys = self._store, self._keys
        me, lock = self.node_id.encode(), keys.sealer(r)
        if store.compare_set(lock, b"", me, ephemeral=True) != me:
            return SealAttempt(held=False)
        status, nodes_dir = keys.status(r), keys.nodes(r)
        history_keys = [round_event_key(keys, r - 1)] if self._history and r > 0 else []
        history_lists = [keys.left_dir(r)] if self._history else []
        written: bool | None = None
        attempt = SealAttempt(held=True)
        with store.batch():
            try:
                reads = store.read_many(keys=[status, *history_keys],
                                        lists=[nodes_dir, *history_lists])
                if reads.values[status] is None:  # not sealed (nor closed) before the lock was ours
                    written, attempt = self._seal(r, reads.lists[nodes_dir], reads)
            except BaseException:
                with contextlib.suppress(StoreError):  # the lock may be another node's by now
                    store.compare_set(lock, me, b"", ephemeral=True)
                raise
            if written is None:  # nothing written: release the lock (a quiet write)
                store.set(lock, b"", ephemeral=True)
            elif not written:  # fenced off: release the lock only if it is still this node's
                store.compare_set(lock, me, b"", ephemeral=True)
        return attempt

    def wait(self, r: int, seconds: float, watch: Callable[[str, int, float], int]) -> None:
        """Wait (at most ``seconds``) until the node holding round r's sealer lock releases it
        (done, or dead).

        The lock lives outside ``ctl/``: taking it wakes no one; only the nodes that also
        tried to seal wait on it. The revision is read before the lock is seen held, so a
        release in between is not missed."""
        store, lock = self._store, self._keys.sealer(r)
        since = store.revision(lock)
        if store.try_get(lock):  # held: a node id (missing or empty: free)
            watch(lock, since, seconds)

    def _seal(self, r: int, listed: dict[str, bytes], reads: Reads) -> tuple[bool | None, SealAttempt]:
        """Write round r's decision and each joiner's rank, given the ``listed`` descriptors
        (lock held). Returns whether it was written (None: nothing to write, with fewer than
        min_nodes joiners left: the others re-evaluate) and the attempt."""
        keys, prefix = self._keys, len(self._keys.nodes(r))
        joiners = {}
        for key, raw in listed.items():
            node = decode_node(key, raw)
            if node.node_id != key[prefix:]:
                raise RendezvousStateError(
                    f"rendezvous key {key!r} holds the descriptor of node {node.node_id!r}"
                )
            joiners[node.node_id] = node
        ranks = plan_ranks(joiners, self._rules)
        if ranks is None:
            return None, SealAttempt(held=True)
        event = self._round_event(r, ranks, joiners, reads)
        # A record says "fenced" (its member needs no read of the status) only if the whole
        # decision, lock included, is one atomic write: etcd splits a long one.
        limit = self._store.capabilities.atomic_writes
        fenced = self._fence and (limit is None or len(ranks) + 4 <= limit)
        rank0 = joiners[next(node_id for node_id, rank in ranks.items() if rank == 0)]
        decision = Decision(len(ranks), rank0.host, rank0.port,
                            seal_of(self.node_id, ranks, rank0.host, rank0.port), fenced)
        records, status = encode_ranks(ranks, decision), encode_decision(decision)
        names = [keys.rank(r, node_id) for node_id in records]
        values = list(records.values())
        left_marks: list[str] = []
        if event is not None:  # the history's event travels with the seal (no round trip)
            names.append(round_event_key(keys, r))
            values.append(encode_event(event[0]))
            left_marks = event[1]
        names += [keys.status(r), keys.sealed]
        values += [status, str(r).encode()]
        try:
            written = self._write_decision(r, names, values)
        except StoreUnsupportedError as exc:  # (once: the records must not claim a fence)
            logger.warning("rendezvous %s: %s; sealing without fencing", keys.run_id, exc)
            self._fence = False
            return self._seal(r, listed, reads)
        if not written:
            logger.warning("rendezvous %s round %d: %s lost the sealer lock before its decision "
                           "was written (paused longer than its session ttl?); it reads the "
                           "round's decision instead", keys.run_id, r, self.node_id)
            return False, SealAttempt(held=True)
        logger.info("rendezvous %s round %d sealed by %s: world_size %d",
                    keys.run_id, r, self.node_id, decision.world_size)
        mine = records.get(self.node_id)
        return True, SealAttempt(True, None if mine is None else (mine, status), left_marks)

    def _round_event(
        self, r: int, ranks: dict[str, int], joiners: dict[str, NodeDescriptor], reads: Reads
    ) -> tuple[RunEvent, list[str]] | None:
        """The history's ``round_formed`` event of this decision and the leave marks it
        consumed; None without a history, or if it cannot be built (the history never fails
        a seal: a corrupt earlier event loses this one, not the round)."""
        if not self._history:
            return None
        try:
            return round_event(self._keys, r, ranks, joiners, reads, self.node_id)
        except Exception as exc:  # noqa: BLE001 - whatever the history holds
            logger.warning("rendezvous %s round %d: no history event for this round: %s: %s",
                           self._keys.run_id, r, type(exc).__name__, exc)
            return None

    def _write_decision(self, r: int, names: list[str], values: list[bytes]) -> bool:
        """Write round r's decision, ``names`` (its status and ``sealed`` pointer last), and
        empty the sealer lock with it, only while the lock names this node and the round has
        no status (:meth:`Store.multi_set_if`: a lock lost while paused, or a round closed
        meanwhile, fences the write off); whether it was written.

        A store that cannot write conditionally (a store server older than fencing) gets the
        rank records, then the status only if the round has none (``compare_set``: a stale
        sealer never replaces another decision's status), then the ``sealed`` pointer and the
        release; a read of ``closed`` sees a ``set_closed`` that came first (the next round is
        closed too). The members check their rank records against the status
        (:func:`check_rank`), so a stale sealer's records are not taken.
        """
        store, keys = self._store, self._keys
        lock, status = keys.sealer(r), keys.status(r)
        if self._fence:
            return store.multi_set_if(
                {lock: self.node_id.encode(), status: None}, [*names, lock], [*values, b""]
            )
        *records, (_, ours), (sealed, pointer) = zip(names, values)
        store.multi_set([name for name, _ in records], [value for _, value in records])
        written = store.compare_set(status, b"", ours) == ours
        if written:
            store.set(sealed, pointer)
            store.set(lock, b"", ephemeral=True)
        else:
            store.compare_set(lock, self.node_id.encode(), b"", ephemeral=True)
        if store.try_get(keys.closed) is not None:
            store.compare_set(keys.status(r + 1), b"", CLOSED_STATUS)
        return written
