"""A run's event history: the model, its store encoding, the reader and the pruning rule.

Every event of run ``<run>`` is one key under ``rdzv/<run>/events/``:

=================================  ============================================================
key                                event
=================================  ============================================================
``events/r<round, 10 digits>``     ``round_formed`` of that round, written by its sealer in the
                                   seal's own ``multi_set`` (nameable: no counter round trip;
                                   the next sealer reads it in its own read to name who left)
``events/e<seq, 16 digits>.<tag>`` any other event; ``tag`` names the writing process
=================================  ============================================================

A value is a JSON object ``{"v": 1, "t": "event", "seq", "time", "kind", "round", "node",
"fields"}``. ``seq`` is the writer's wall clock in microseconds when it wrote the event, made
strictly increasing within a process: it orders the writes of a run (gaps allowed) with no
store round trip; ``time`` is when the event happened (earlier for an event written in the
background), and the reader returns events in that order. Writes at the same moment on two
hosts are ordered to within their clocks' skew; a follower (``since_seq``) passes ``settle_s``
to read only events written at least that long ago, so that one that reaches the store a
little late (a skewed clock, a slow write) is not skipped.

The history is bounded: writers prune it (:func:`prune_plan`) to the newest ``history_size``
events once it exceeds that by :func:`prune_slack`. A record that is not valid is reported in
:attr:`EventLog.corrupt` and skipped; pruning removes corrupt records first.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Union

from ..errors import RendezvousError, RendezvousStateError
from ..store import Store
from ._layout import RunKeys

logger = logging.getLogger(__name__)

HISTORY_VERSION = 1
"""The ``"v"`` of every event record."""
DEFAULT_HISTORY_SIZE = 10_000
"""The newest events a run keeps (the rendezvous option ``history_size``)."""
MAX_LIST = 256
"""Lists in an event (members, newcomers, who left) keep at most this many entries; the full
length is in ``<name>_count``."""

EVENT_KINDS = (
    "round_formed",
    "node_waiting",
    "spare_waiting",
    "node_leaving",
    "node_lost",
    "workers_started",
    "worker_failed",
    "workers_restarted",
    "switched_in_process",
    "recovered_in_process",
    "training_paused",
    "run_closed",
)
LEAVE_REASONS = ("graceful_leave", "connection_lost", "heartbeat_missed", "closed", "lost")
"""Why a member of the previous round is not in a new one; ``lost``: gone, cause unknown."""

_EVENTS = "events/"
_ROUND_PREFIX = "r"
_EVENT_PREFIX = "e"


@dataclass(frozen=True)
class RunEvent:
    """One event of a run's history."""

    seq: int
    """Orders the writes of a run's events (increasing; gaps allowed): the writer's clock in µs
    when it wrote the event (``time`` may be earlier: an event written in the background)."""
    time: float
    """Unix seconds (wall clock of the writer) when it happened."""
    kind: str
    """One of :data:`EVENT_KINDS`."""
    round: int | None = None
    """The round it concerns, if any."""
    node: str | None = None
    """Who reports it (a node id ``host:pid:random`` or ``host:pid``), if known."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Kind-specific, JSON values only (see docs/history.md)."""

    def to_json(self) -> dict[str, Any]:
        """Stable field names: ``seq, time, kind, round, node`` and the kind's ``fields``
        (under ``"fields"``, never merged, so a field cannot shadow the common ones)."""
        return {"seq": self.seq, "time": self.time, "kind": self.kind, "round": self.round,
                "node": self.node, "fields": self.fields}


@dataclass(frozen=True)
class EventLog:
    """What :func:`read_events` found."""

    events: list[RunEvent]
    """Oldest first (by ``time``: when they happened)."""
    corrupt: list[str]
    """One message per unreadable record (reported, skipped)."""
    next_seq: int
    """Pass as ``since_seq`` to get only newer events (``--follow``, polling)."""


def events_dir(keys: RunKeys) -> str:
    return keys.base + _EVENTS


def round_event_key(keys: RunKeys, r: int) -> str:
    """The key of round ``r``'s ``round_formed`` event (written with the seal)."""
    return f"{events_dir(keys)}{_ROUND_PREFIX}{r:010d}"


def event_key(keys: RunKeys, event: RunEvent, tag: str) -> str:
    return f"{events_dir(keys)}{_EVENT_PREFIX}{event.seq:016d}.{tag}"


class _Clock:
    """Strictly increasing microseconds of the wall clock, per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def stamp(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, int(time.time() * 1e6))
            return self._last


_clock = _Clock()


def new_event(kind: str, *, round: int | None = None, node: str | None = None,
              at: float | None = None, **fields: Any) -> RunEvent:
    """An event stamped now (``at``: when it happened, if earlier than now)."""
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown event kind {kind!r}; one of {', '.join(EVENT_KINDS)}")
    seq = _clock.stamp()
    return RunEvent(seq, seq / 1e6 if at is None else at, kind, round, node,
                    {name: value for name, value in fields.items() if value is not None})


def clip(values: Iterable[Any]) -> list[Any]:
    """At most :data:`MAX_LIST` of ``values`` (an event stays small however large the job)."""
    out = list(values)
    return out[:MAX_LIST]


def encode_event(event: RunEvent) -> bytes:
    return json.dumps({"v": HISTORY_VERSION, "t": "event", **event.to_json()},
                      separators=(",", ":")).encode()


def decode_event(key: str, raw: bytes) -> RunEvent:
    """The event in ``raw``; RendezvousStateError naming ``key`` if it is not a valid one."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RendezvousStateError(
            f"history key {key!r} does not hold JSON ({raw[:40]!r})") from None
    if not isinstance(data, dict) or data.get("t") != "event":
        raise RendezvousStateError(f"history key {key!r} holds {str(data)[:60]!r}, not an event")
    if data.get("v") != HISTORY_VERSION:
        raise RendezvousStateError(
            f"history key {key!r}: event format version {data.get('v')!r}, this rdzv reads "
            f"version {HISTORY_VERSION}; a newer or older rdzv wrote it")
    seq, stamp, kind = data.get("seq"), data.get("time"), data.get("kind")
    round_, node, fields = data.get("round"), data.get("node"), data.get("fields")
    problems = []
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        problems.append(f"seq {seq!r} is not a non-negative integer")
    if not isinstance(stamp, (int, float)) or isinstance(stamp, bool):
        problems.append(f"time {stamp!r} is not a number")
    if not isinstance(kind, str) or not kind:
        problems.append(f"kind {kind!r} is not a name")
    if round_ is not None and (not isinstance(round_, int) or isinstance(round_, bool)):
        problems.append(f"round {round_!r} is not an integer")
    if node is not None and not isinstance(node, str):
        problems.append(f"node {node!r} is not a string")
    if not isinstance(fields, dict):
        problems.append(f"fields {str(fields)[:40]!r} is not an object")
    if problems:
        raise RendezvousStateError(f"history key {key!r}: " + "; ".join(problems))
    return RunEvent(seq, float(stamp), kind, round_, node, fields)  # type: ignore[arg-type]


def read_events(store: Store, run_id: str, *, since_seq: int = 0,
                settle_s: float = 0.0) -> EventLog:
    """The history of run ``run_id`` in ``store``: the events with ``seq > since_seq``, oldest
    first. ``settle_s`` > 0 leaves out events stamped less than that long ago (they come with a
    later call): a follower then misses none written a little late. Never raises for a corrupt
    record (it is reported in :attr:`EventLog.corrupt`); a store error propagates."""
    directory = events_dir(RunKeys(run_id))
    listed = store.list_keys(directory)
    events, corrupt = [], []
    horizon = int((time.time() - settle_s) * 1e6) if settle_s > 0 else None
    for key in sorted(listed):
        try:
            event = decode_event(key, listed[key])
        except RendezvousStateError as exc:
            corrupt.append(str(exc))
            continue
        if event.seq > since_seq and (horizon is None or event.seq <= horizon):
            events.append(event)
    events.sort(key=lambda event: (event.time, event.seq))
    return EventLog(events, corrupt, max((event.seq for event in events), default=since_seq))


# -- bounds ---------------------------------------------------------------------------------------
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


def _seq_of(key: str, raw: bytes) -> int | None:
    try:
        return decode_event(key, raw).seq
    except RendezvousStateError:
        return None


def prune(store: Store, run_id: str, limit: int) -> int:
    """Bring run ``run_id``'s history back to its newest ``limit`` events if it has grown past
    the slack; the number of records deleted. Store errors propagate."""
    directory = events_dir(RunKeys(run_id))
    if store.count_keys(directory) <= limit + prune_slack(limit):
        return 0
    listed = store.list_keys(directory)
    doomed = prune_plan({key: _seq_of(key, raw) for key, raw in listed.items()}, limit)
    for key in doomed:
        store.delete_key(key)
    return len(doomed)


# -- the writer -----------------------------------------------------------------------------------
class EventWriter:
    """Writes events to a run's history from a background thread, off every critical path.

    ``store`` may be a function that opens it: it is then called by the writer's thread.

    :meth:`record` never blocks and never raises: events wait in a bounded queue (the oldest
    waiting ones are dropped past ``max_pending``) and a thread writes them in batches (one
    ``multi_set`` each), then prunes the history when it has grown past its bound. A write the
    store refuses (gone, full, closed) is logged and dropped: the history never fails a run.
    ``limit`` 0 records nothing.
    """

    BATCH = 64
    """Events per ``multi_set`` (etcd's default transaction limit is 128 operations)."""

    def __init__(self, store: Union[Store, Callable[[], Store]], run_id: str, *, tag: str,
                 limit: int = DEFAULT_HISTORY_SIZE, max_pending: int = 1000) -> None:
        if "/" in tag or not tag:
            raise ValueError(f"tag {tag!r} must be non-empty without '/'")
        self._store_or_factory = store
        self._keys, self._tag = RunKeys(run_id), tag
        self._limit, self._max_pending = limit, max_pending
        self._pending: list[RunEvent] = []
        self._cond = threading.Condition()
        self._busy = False
        self._held = False
        """The queued events wait for :meth:`release` (all of them were deferred)."""
        self._closed = False
        self._thread: threading.Thread | None = None
        self._failures = 0
        self.dropped = 0
        """Events not written (queue full, store errors)."""

    @property
    def limit(self) -> int:
        return self._limit

    def _store(self) -> Store:
        """The store (opened on first use if a factory was given: by the writer's thread)."""
        if not isinstance(self._store_or_factory, Store):
            self._store_or_factory = self._store_or_factory()
        return self._store_or_factory

    def record(self, kind: str, *, round: int | None = None, node: str | None = None,
               at: float | None = None, defer: bool = False, **fields: Any) -> RunEvent | None:
        """Queue an event (see :func:`new_event`); the event, or None if not recorded.

        ``defer``: keep it queued until :meth:`release` or the next event not deferred (a node
        joining a round records its arrival so, and releases it once the round is formed: no
        thread, connection or write competes with the round). An event is stamped (its
        ``seq``) when it is written; its ``time`` is when it happened."""
        if self._limit <= 0:
            return None
        event = new_event(kind, round=round, node=node, at=at, **fields)
        with self._cond:
            if self._closed:
                return None
            if len(self._pending) >= self._max_pending:
                self._pending.pop(0)
                self.dropped += 1
            if not defer:
                self._release()
            elif not self._pending:
                self._held = True
            self._pending.append(event)
        return event

    def release(self) -> None:
        """Write the deferred events (in the background)."""
        with self._cond:
            if self._pending:
                self._release()

    def _release(self) -> None:
        """(Lock held.) Wake the writer thread, starting it on first use."""
        self._held = False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rdzv-history", daemon=True)
            self._thread.start()
        self._cond.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (at most ``timeout`` s) until every queued event is written or dropped."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._pending:
                self._release()
            while self._pending or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Write what is queued (at most ``timeout`` s), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._pending or self._held) and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                batch, self._pending = self._pending[:self.BATCH], self._pending[self.BATCH:]
                self._busy = True
            try:
                self._write(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, batch: list[RunEvent]) -> None:
        batch = [replace(event, seq=_clock.stamp()) for event in batch]  # written now
        names = [event_key(self._keys, event, self._tag) for event in batch]
        try:
            store = self._store()
            store.multi_set(names, [encode_event(event) for event in batch])
            pruned = prune(store, self._keys.run_id, self._limit)
            if pruned:
                logger.debug("history of %s: pruned %d old events", self._keys.run_id, pruned)
            self._failures = 0
        except (RendezvousError, OSError, ValueError) as exc:
            self.dropped += len(batch)
            self._failures += 1
            # The first failure in a row is worth a warning; the store may stay gone a while.
            log = logger.warning if self._failures == 1 else logger.debug
            log("history of %s: %d event(s) not recorded: %s", self._keys.run_id, len(batch), exc)
