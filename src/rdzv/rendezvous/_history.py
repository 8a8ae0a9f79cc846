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
"fields"}`` of at most :data:`MAX_EVENT_BYTES`, with finite numbers only. ``seq`` is the writer's
wall clock in microseconds right before it wrote the event, made strictly increasing within a
process: it orders the writes of a run (gaps allowed) with no store round trip; ``time`` is when
the event happened (earlier for an event written in the background), and the reader returns
events in that order. A follower does not rely on ``seq`` to find what is new (a write may land
late, a host's clock may lag): it passes the last :class:`EventLog` back (``after``) and gets
the events whose keys it had not seen (keys are unique, the history is bounded).

The history is bounded (``_history_bounds.py``): writers prune it to the newest ``history_size``
events (capped) once it exceeds that by a slack, so that listing it stays far below the store's
64 MiB frame. A record that is not valid is reported in :attr:`EventLog.corrupt` and skipped;
pruning removes corrupt records first.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Union

from ..errors import RendezvousStateError
from ..store import Store
from ._history_bounds import DEFAULT_HISTORY_SIZE, MAX_EVENT_BYTES, capped_limit, prune
from ._layout import RunKeys, compact_json

logger = logging.getLogger(__name__)

HISTORY_VERSION = 1
"""The ``"v"`` of every event record."""
MAX_TIME = 1e10
"""Event times are unix seconds in [0, MAX_TIME) (year 2286): anything else is corrupt."""

EVENT_KINDS = (
    "round_formed",
    "node_waiting",
    "spare_waiting",
    "node_leaving",
    "node_lost",
    "node_refused",
    "workers_started",
    "worker_failed",
    "workers_restarted",
    "worker_hung",
    "straggler_flagged",
    "straggler_cleared",
    "straggler_replaced",
    "restart_fallback",
    "switched_in_process",
    "recovered_in_process",
    "training_paused",
    "run_closed",
)
RESTART_CAUSES = ("worker_failed", "transition_failed", "connect_timeout", "lost_at_start",
                  "not_inprocess")
"""Why a round restarts every worker (``restart_fallback``, the only fallback of in-process
changes): a worker failed outside the in-process API; transitions kept failing (workers that
never enter their new group); the workers did not connect to their agent in time; a member
of the group was lost, or left, while the workers were starting in it; a node's workers do
not use the API (or ``--restart-on-change``)."""
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
    """The highest ``seq`` returned (or the ``since_seq`` given): a coarse cut for polling;
    a follower passes the log itself as ``after`` instead (it misses no late write)."""
    keys: frozenset[str] = frozenset()
    """The keys of the events this read returned or had already seen (``after``,
    ``since_seq``), of those still stored: a follower's cursor, bounded like the history."""


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


def encode_event(event: RunEvent) -> bytes:
    """The record of ``event``; ValueError (NaN, infinity) or TypeError (not JSON) if a value
    cannot be one."""
    return compact_json({"v": HISTORY_VERSION, "t": "event", **event.to_json()}, finite=True)


def event_record(event: RunEvent) -> bytes:
    """:func:`encode_event`, and ValueError if the record is longer than an event may be."""
    record = encode_event(event)
    if len(record) > MAX_EVENT_BYTES:
        raise ValueError(f"its record would take {len(record)} bytes, over the "
                         f"{MAX_EVENT_BYTES} an event may")
    return record


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def decode_event(key: str, raw: bytes) -> RunEvent:
    """The event in ``raw``; RendezvousStateError naming ``key`` if it is not a valid one."""
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RendezvousStateError(
            f"history key {key!r} does not hold JSON with finite numbers ({raw[:40]!r}: "
            f"{str(exc)[:60]})") from None
    if not isinstance(data, dict) or data.get("t") != "event":
        raise RendezvousStateError(f"history key {key!r} holds {str(data)[:60]!r}, not an event")
    if data.get("v") != HISTORY_VERSION:
        raise RendezvousStateError(
            f"history key {key!r}: event format version {data.get('v')!r}, this rdzv reads "
            f"version {HISTORY_VERSION}; a newer or older rdzv wrote it")
    seq, stamp, kind = data.get("seq"), data.get("time"), data.get("kind")
    round_, node, fields = data.get("round"), data.get("node"), data.get("fields")
    problems = []
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 1 << 63:
        problems.append(f"seq {seq!r} is not a non-negative 64-bit integer")
    if (not isinstance(stamp, (int, float)) or isinstance(stamp, bool)
            or not 0 <= stamp < MAX_TIME):
        problems.append(f"time {stamp!r} is not unix seconds")
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


def read_events(store: Store, run_id: str, *, after: EventLog | None = None,
                since_seq: int = 0, settle_s: float = 0.0) -> EventLog:
    """The history of run ``run_id`` in ``store``, oldest first. Never raises for a corrupt
    record (it is reported in :attr:`EventLog.corrupt`); a store error propagates.

    ``after``: a log this function returned before: only the events it had not seen (a
    follower passes each log back; it misses none, however late a write lands). ``since_seq``
    leaves out events with ``seq <= since_seq``, and ``settle_s`` > 0 those stamped less than
    that long ago (they come with a later call): a cruder way to poll, which misses a write
    that lands later than ``settle_s`` after its stamp."""
    directory = events_dir(RunKeys(run_id))
    listed = store.list_keys(directory)
    seen = after.keys if after is not None else frozenset()
    events, corrupt, known = [], [], []
    horizon = int((time.time() - settle_s) * 1e6) if settle_s > 0 else None
    for key in sorted(listed):
        if key in seen:
            known.append(key)
            continue
        try:
            event = decode_event(key, listed[key])
        except RendezvousStateError as exc:
            corrupt.append(str(exc))
            continue
        if event.seq <= since_seq:
            known.append(key)
        elif horizon is None or event.seq <= horizon:
            events.append(event)
            known.append(key)
    events.sort(key=lambda event: (event.time, event.seq))
    return EventLog(events, corrupt, max((event.seq for event in events), default=since_seq),
                    frozenset(known))


def _seq_of(key: str, raw: bytes) -> int | None:
    try:
        return decode_event(key, raw).seq
    except RendezvousStateError:
        return None


# -- the writer -----------------------------------------------------------------------------------
class EventWriter:
    """Writes events to a run's history from a background thread, off every critical path.

    ``store`` may be a function that opens it: it is then called by the writer's thread.

    :meth:`record` never blocks and never raises (an event it cannot record, an unknown kind or
    a value that is not JSON, is logged and dropped): events wait in a bounded queue (the oldest
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
        self._limit, self._max_pending = capped_limit(limit, run_id), max_pending
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
        thread, connection, write or encoding competes with the round; a deferred event that
        cannot be a record is dropped when it is written). An event is stamped (its ``seq``)
        when it is written; its ``time`` is when it happened."""
        if self._limit <= 0:
            return None
        try:
            event = new_event(kind, round=round, node=node, at=at, **fields)
            if not defer:
                event_record(event)
        except (TypeError, ValueError) as exc:  # an unknown kind, a value that is not JSON
            self._drop(kind, exc)
            return None
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

    def _drop(self, kind: str, exc: Exception) -> None:
        logger.warning("history of %s: event %r not recorded: %s", self._keys.run_id, kind, exc)
        with self._cond:
            self.dropped += 1

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
        """Write ``batch``, then prune; an error of either is logged (the thread lives on)."""
        keys: list[str] = []
        records: list[bytes] = []
        invalid = 0
        try:
            store = self._store()
            for event in batch:
                # Stamped right before the write: seq tells the order the writes reached the store.
                stamped = replace(event, seq=_clock.stamp())
                try:
                    records.append(event_record(stamped))
                except (TypeError, ValueError) as exc:  # (a deferred one, not checked before)
                    self._drop(event.kind, exc)
                    invalid += 1
                    continue
                keys.append(event_key(self._keys, stamped, self._tag))
            if not keys:
                return
            store.multi_set(keys, records)
            self._failures = 0
        except Exception as exc:  # a store error (or a bug): never the thread's end
            lost = len(batch) - invalid
            with self._cond:
                self.dropped += lost
            self._failures += 1
            # The first failure in a row is worth a warning; the store may stay gone a while.
            log = logger.warning if self._failures == 1 else logger.debug
            log("history of %s: %d event(s) not recorded: %s: %s", self._keys.run_id,
                lost, type(exc).__name__, exc)
            return
        try:
            pruned = prune(store, events_dir(self._keys), self._keys.base + "history_prune",
                           self._limit, self._tag, _seq_of)
        except Exception as exc:
            logger.warning("history of %s: pruning failed: %s: %s", self._keys.run_id,
                           type(exc).__name__, exc)
            return
        if pruned:
            logger.debug("history of %s: pruned %d old events", self._keys.run_id, pruned)
