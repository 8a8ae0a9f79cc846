"""What the web view and ``/metrics`` read: the runs of one store, their state and history.

The page polls JSON built here (:func:`runs_payload`, :func:`run_payload`), with the field names
of ``rdzv status --json`` (``RunStatus.as_dict``) and of the history's ``RunEvent.to_json``, so
the page, the command line and scripts read the same shapes.

A :class:`RunSource` reads through a store client, as ``rdzv status`` does, so it serves every
backend ``rdzv status`` reads. It opens its client on first use and opens a new one after an
error (the store server may restart while the view runs), and calls it from one thread at a
time (the HTTP server answers requests on several).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import RendezvousError, SourceUnavailable
from ..rendezvous import ROOT, EventLog, RunKeys, RunStatus, events_dir, read_events, read_status
from ..server import ServerMetricsSnapshot
from ..store import Store

log = logging.getLogger(__name__)

RUNS_TTL = 2.0
"""Seconds a list of the runs found is reused before it is listed again."""
MAX_EVENTS = 2000
"""Events sent in one answer at most (the page asks again from ``next_seq`` for the rest)."""
SETTLE_S = 0.5
"""A reader that asks for the events after the last it saw reads only those stamped at least
this long ago: one written a little late (a background writer, another host's clock) is then
not skipped (see :func:`~rdzv.rendezvous._history.read_events`)."""


@dataclass(frozen=True)
class _Seen:
    """The last read of a run's history."""

    revision: int
    """The history's revision then."""
    first: float
    """When this revision was first seen (wall clock, as the events' stamps)."""
    settled: bool
    """The read came :data:`SETTLE_S` after that and left out no event for being too recent
    (stamped after its settle horizon, e.g. by a clock ahead of this one): it returned every
    event of this revision."""
    next_seq: int
    corrupt: list[str]


__all__ = ["RunSource", "SourceUnavailable", "run_payload", "runs_payload", "server_runs"]


class RunSource:
    """The runs of one store, read on demand.

    ``open_store`` makes a client (called again after an error); ``runs`` lists the run ids to
    show (None: one run, ``run_id``); ``server_metrics`` gives the store server's own numbers
    when the view runs inside ``rdzv serve``.
    """

    def __init__(
        self,
        open_store: Callable[[], Store],
        *,
        run_id: str | None = None,
        runs: Callable[[], list[str]] | None = None,
        server_metrics: Callable[[], ServerMetricsSnapshot] | None = None,
        where: str = "",
    ) -> None:
        if (run_id is None) == (runs is None):
            raise ValueError("give either run_id (one run) or runs (a function listing them)")
        self._open_store = open_store
        self._run_id = run_id
        self._runs = runs
        self._server_metrics = server_metrics
        self.where = where
        """The store, in words (shown on the page)."""
        self._store: Store | None = None
        self._lock = threading.RLock()  # (held while reading: run_ids may prune _seen then)
        self._listed: tuple[float, list[str]] = (-RUNS_TTL, [])
        self._seen: dict[str, _Seen] = {}

    # -- reads ------------------------------------------------------------------------------------
    def run_ids(self) -> list[str]:
        """The runs to show, sorted (listed again at most every :data:`RUNS_TTL` seconds)."""
        if self._run_id is not None:
            return [self._run_id]
        assert self._runs is not None
        stamp, runs = self._listed
        if time.monotonic() - stamp >= RUNS_TTL:
            try:
                runs = sorted(self._runs())
            except RendezvousError as exc:
                raise SourceUnavailable(f"cannot list the runs of {self.where}: {exc}") from exc
            self._listed = (time.monotonic(), runs)
            with self._lock:  # what is kept of the runs gone goes with them
                self._seen = {run: seen for run, seen in self._seen.items() if run in runs}
        return runs

    def has_run(self, run_id: str) -> bool:
        """Whether ``run_id`` is one of :meth:`run_ids` (the only ones answered for)."""
        return run_id in self.run_ids()

    def status(self, run_id: str) -> RunStatus:
        """The state of ``run_id`` now (as ``rdzv status`` shows it)."""
        return self._read(lambda store: read_status(store, run_id))

    def events(self, run_id: str, since_seq: int = 0) -> EventLog:
        """The recorded events of ``run_id`` after ``since_seq`` (those older than
        :data:`SETTLE_S`: pass ``next_seq`` back to read on)."""
        return self._read(lambda store: self._events(store, run_id, since_seq))

    def new_events(self, run_id: str, after: EventLog | None) -> EventLog:
        """The events of ``run_id`` that ``after`` (this method's previous answer; None: the
        first read) had not seen, however late their writes landed (for totals that count
        each event once)."""
        return self._read(lambda store: read_events(store, run_id, after=after))

    def _events(self, store: Store, run_id: str, since_seq: int) -> EventLog:
        # Reading the history lists all of it: skip that while nothing was written since a
        # read that came SETTLE_S after the last write was first seen (it had every event then).
        revision = store.revision(events_dir(RunKeys(run_id)))
        now = time.time()
        seen = self._seen.get(run_id)
        if seen is not None and seen.revision == revision:
            if seen.settled and since_seq == seen.next_seq:
                return EventLog([], seen.corrupt, since_seq)
            first = seen.first
        else:
            first = now
        # The settle horizon is applied here, not by read_events: a read is settled only if it
        # left out nothing for being too recent (an event stamped ahead of this clock would
        # otherwise stay hidden until the next write).
        horizon = int((now - SETTLE_S) * 1e6)
        everything = read_events(store, run_id, since_seq=since_seq)
        events = [event for event in everything.events if event.seq <= horizon]
        history = EventLog(events, everything.corrupt,
                           max((event.seq for event in events), default=since_seq))
        settled = now - first >= SETTLE_S and len(events) == len(everything.events)
        if run_id in self._seen or self.has_run(run_id):  # (kept for the runs shown only)
            self._seen[run_id] = _Seen(revision, first, settled, history.next_seq,
                                       history.corrupt)
        return history

    def server(self) -> ServerMetricsSnapshot | None:
        """The store server's numbers (None: the view does not run inside the server)."""
        if self._server_metrics is None:
            return None
        try:
            return self._server_metrics()
        except RendezvousError:  # not started yet, or stopping
            return None

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._close_store()

    # -- the store client -------------------------------------------------------------------------
    def _read(self, read: Callable[[Store], Any]) -> Any:
        with self._lock:
            try:
                if self._store is None:
                    self._store = self._open_store()
                return read(self._store)
            except (RendezvousError, OSError) as exc:
                if self._store is not None:
                    self._close_store()
                raise SourceUnavailable(f"cannot read {self.where}: {exc}") from exc

    def _close_store(self) -> None:
        store, self._store = self._store, None
        try:
            store.close()  # type: ignore[union-attr]
        except (RendezvousError, OSError) as exc:  # a broken client: nothing more to do
            log.debug("closing the store client failed: %s", exc)


def server_runs(directories: Callable[[str], list[str]]) -> Callable[[], list[str]]:
    """The run lister of a store server (its ``directories`` method): every run with keys."""
    return lambda: directories(f"{ROOT}/")


def runs_payload(source: RunSource) -> dict[str, Any]:
    """``/api/runs``: each run's state, round, size and waiting nodes; the store server's
    connections, sessions and keys when the view runs inside it."""
    runs: list[dict[str, Any]] = []
    for run_id in source.run_ids():
        try:
            status = source.status(run_id)
        except SourceUnavailable as exc:
            runs.append({"run_id": run_id, "state": "unreadable", "error": str(exc)})
            continue
        runs.append({"run_id": run_id, "state": status.state, "round": status.round,
                     "world_size": status.world_size, "waiting": status.waiting,
                     "spares": status.spares})
    return {"time": time.time(), "where": source.where, "runs": runs,
            "server": _server(source.server())}


def run_payload(source: RunSource, run_id: str, since_seq: int) -> dict[str, Any]:
    """``/api/run/<id>``: the run's status now and its events after ``since_seq``."""
    status = source.status(run_id)
    history = source.events(run_id, since_seq)
    events = history.events
    next_seq = history.next_seq
    if len(events) > MAX_EVENTS:  # the first ones by seq: the rest come with the next call
        events = sorted(events, key=lambda event: event.seq)[:MAX_EVENTS]
        next_seq = events[-1].seq
    return {
        "time": time.time(),
        "status": status.as_dict(),
        "events": [event.to_json() for event in events],
        "next_seq": next_seq,
        "corrupt": list(history.corrupt),
    }


def _server(snapshot: ServerMetricsSnapshot | None) -> dict[str, Any] | None:
    if snapshot is None:
        return None
    return {
        "connections": snapshot.stats.get("connections", 0),
        "sessions": snapshot.stats.get("sessions", 0),
        "keys": snapshot.stats.get("keys", 0),
        "requests": sum(snapshot.requests.values()),
        "durable": snapshot.wal_bytes is not None,
    }
