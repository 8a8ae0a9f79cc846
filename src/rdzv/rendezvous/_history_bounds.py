"""The bounds of a run's history: how large an event and the history may be, how far it may
grow before it is pruned, which records pruning deletes (pure), and the pruning itself, done by
one writer at a time.

An event's record is at most :data:`MAX_EVENT_BYTES` and a history keeps at most
:data:`MAX_HISTORY_SIZE` events (plus the slack): listing the whole history, which one store
message carries, stays under the store's 64 MiB frame.

Every writer counts the events after each batch it writes (one ``count_keys``). Once they
exceed the bound by the slack, the writers that saw it compete for a prune marker
(``rdzv/<run>/history_prune``, one ``compare_set``): the one that takes it lists the history and
deletes the oldest records back to the bound (in one :meth:`~rdzv.store.Store.batch`, for a
store that pipelines them), then gives the marker back. The others go on writing: no stampede
of listings and deletes when every node crosses the bound at the same moment. Should the
history still grow past twice the slack (the writers outpace the pruner), every writer prunes
before it writes again: a hard bound. A marker whose holder died is taken over once its lease
(:data:`PRUNE_LEASE_S`) has run out.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Mapping

from ..store import Store

logger = logging.getLogger(__name__)

DEFAULT_HISTORY_SIZE = 10_000
"""The newest events a run keeps (the rendezvous option ``history_size``)."""
MAX_HISTORY_SIZE = 12_000
"""``history_size`` is capped to this: the listing of a full history (with its slack, at
:data:`MAX_EVENT_BYTES` a record) stays below 56 MB, under the store's 64 MiB frame."""
MAX_LIST = 256
"""Lists in an event (members, newcomers, who left) keep at most this many entries; the full
length is in ``<name>_count``."""
MAX_EVENT_BYTES = 4096
"""An event's record is at most this long: a ``round_formed`` clips its lists further to fit,
:meth:`~rdzv.rendezvous.EventWriter.record` drops a larger event (logged)."""
PRUNE_LEASE_S = 30.0
"""How long a prune marker is held at most (its holder died: another writer takes it over)."""


def capped_limit(limit: int, run_id: str) -> int:
    """``history_size`` ``limit`` of run ``run_id``, capped to :data:`MAX_HISTORY_SIZE` (with a
    warning: a larger history could not be listed in one store message)."""
    if limit > MAX_HISTORY_SIZE:
        logger.warning("history_size %d of run %s is capped to %d (the listing of its history "
                       "must fit in one store message)", limit, run_id, MAX_HISTORY_SIZE)
    return min(limit, MAX_HISTORY_SIZE)


def prune_slack(limit: int) -> int:
    """How far past ``limit`` the history may grow before a writer prunes it (pruning works in
    batches: one count per flush, one listing per batch)."""
    return min(1000, max(16, limit // 10))


def prune_plan(seqs: Mapping[str, int | None], limit: int) -> list[str]:
    """The keys to delete so that the newest ``limit`` events of ``seqs`` (key -> seq, None for
    a corrupt record) remain: none until they exceed ``limit + prune_slack(limit)``; then the
    corrupt ones first, then the oldest (ties by key)."""
    if len(seqs) <= limit + prune_slack(limit):
        return []
    order = sorted(seqs, key=lambda key: (seqs[key] is not None, seqs[key] or 0, key))
    return order[:len(seqs) - limit]


def may_take(marker: bytes | None, now: float) -> bool:
    """Whether a prune marker's value lets a writer take it: absent, given back, unreadable, or
    its lease run out."""
    if marker is None:
        return True
    try:
        until = json.loads(marker).get("until")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return True
    return not isinstance(until, (int, float)) or isinstance(until, bool) or until <= now


def _take(store: Store, marker_key: str, holder: str) -> bytes | None:
    """Take the prune marker for ``holder``; its new value, or None if another writer holds it
    (or took it first)."""
    now = time.time()
    current = store.try_get(marker_key)
    if not may_take(current, now):
        return None
    mine = json.dumps({"holder": holder, "until": now + PRUNE_LEASE_S}).encode()
    return mine if store.compare_set(marker_key, current or b"", mine) == mine else None


def prune(store: Store, directory: str, marker_key: str, limit: int, holder: str,
          seq_of: Callable[[str, bytes], int | None]) -> int:
    """Bring the history under ``directory`` back to its newest ``limit`` records if it has
    grown past the slack and no other writer is pruning it; the number of records deleted.
    ``seq_of`` reads a record's seq (None: corrupt). Store errors propagate."""
    count = store.count_keys(directory)
    if count <= limit + prune_slack(limit):
        return 0
    mine = _take(store, marker_key, holder)
    if mine is None and count <= limit + 2 * prune_slack(limit):
        return 0  # another writer is pruning
    # (Past twice the slack the pruner is not keeping up: every writer prunes, none writes.)
    try:
        listed = store.list_keys(directory)
        doomed = prune_plan({key: seq_of(key, raw) for key, raw in listed.items()}, limit)
        with store.batch():
            for key in doomed:
                store.delete_key(key)
    finally:
        if mine is not None:
            store.compare_set(marker_key, mine, json.dumps({"until": 0}).encode())
    return len(doomed)
