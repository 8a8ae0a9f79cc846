"""``/metrics``: the store server's numbers and each run's, in Prometheus' text format.

Built with ``prometheus_client`` (the ``rdzv[monitor]`` extra), imported only here and only
when the monitor starts: the store server counts with plain integers (:mod:`rdzv.server._metrics`)
and :class:`MonitorCollector` maps them, and each run's status and history, to metric families
at scrape time.

:class:`RunTotals` adds up what a run's events say (rounds formed by cause, how long each round
took to form, how long training paused for each change, worker failures), with no I/O; the
collector keeps one per run and folds in only the events its last read of the history had not
seen (``read_events(..., after=...)``, by their keys: a write that lands late is counted at the
next scrape, never skipped), so a scrape counts each event once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from ..errors import RendezvousParameterError, SourceUnavailable
from ..rendezvous import EVENT_KINDS, RESTART_CAUSES, EventLog
from ..server import Histogram, HistogramSnapshot, ServerMetricsSnapshot
from ._source import RunSource

if TYPE_CHECKING:
    from ..rendezvous import RunStatus

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'rdzv[monitor]'"
FORMATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) of the round formation histogram's buckets."""
PAUSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
"""Upper bounds (seconds) of the training pause histogram's buckets."""
PAUSE_KINDS = ("training_paused", "switched_in_process", "recovered_in_process")
"""Events that say how long training paused (``pause_s``)."""
UNKNOWN = "unknown"
"""The label of an event without the field."""
OTHER = "other"
"""The label of a value not in the lists below: labels never take arbitrary text from the
history (each value is a time series in Prometheus)."""
ROUND_CAUSES = ("initial", "join", "leave", "loss", "restart")
"""The ``cause`` of a ``round_formed`` event."""
PAUSE_CAUSES = ("worker_failed", "membership_change", "member_lost", *PAUSE_KINDS)
"""The ``cause`` of a training pause (the event's kind when it has none)."""
FALLBACK_CAUSES = RESTART_CAUSES
"""The ``cause`` of a ``restart_fallback`` event."""


@dataclass
class RunTotals:
    """What a run's events add up to (see the module docstring)."""

    read: EventLog | None = None
    """The last read of the history: the next one asks for the events it had not seen."""
    events: dict[str, int] = field(default_factory=dict)
    """Events seen, by kind."""
    rounds: dict[str, int] = field(default_factory=dict)
    """Rounds formed, by cause."""
    formation: Histogram = field(default_factory=lambda: Histogram(FORMATION_BUCKETS))
    pauses: dict[str, Histogram] = field(default_factory=dict)
    """Training pauses (seconds), by the cause of the change."""
    worker_failures: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    """Restarts of every worker (the fallback of in-process changes), by cause."""
    corrupt: int = 0
    """Records of the history that could not be read at the last read (reported, skipped)."""

    def add(self, events: Iterable[Any], corrupt: int = 0) -> None:
        """Fold in new ``events`` (:class:`~rdzv.rendezvous.RunEvent`) and the count
        of ``corrupt`` records read with them."""
        for event in events:
            kind = _label(event.kind, EVENT_KINDS)
            fields = event.fields
            self.events[kind] = self.events.get(kind, 0) + 1
            if kind == "round_formed":
                cause = _label(fields.get("cause"), ROUND_CAUSES)
                self.rounds[cause] = self.rounds.get(cause, 0) + 1
                took = fields.get("formation_s")
                if _is_seconds(took):
                    self.formation.observe(took)
            elif kind == "worker_failed":
                self.worker_failures += 1
            elif kind == "restart_fallback":
                cause = _label(fields.get("cause"), FALLBACK_CAUSES)
                self.fallbacks[cause] = self.fallbacks.get(cause, 0) + 1
            if kind in PAUSE_KINDS and _is_seconds(fields.get("pause_s")):
                cause = _label(fields.get("cause", kind), PAUSE_CAUSES)
                pauses = self.pauses.get(cause)
                if pauses is None:
                    pauses = self.pauses[cause] = Histogram(PAUSE_BUCKETS)
                pauses.observe(fields["pause_s"])
        self.corrupt = corrupt  # (the reader reports every corrupt record at every read)


def _label(value: Any, known: tuple[str, ...]) -> str:
    if value is None or value == "":
        return UNKNOWN
    return value if value in known else OTHER


def _is_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def require_prometheus() -> Any:
    """The ``prometheus_client`` module, or an error saying how to install it."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401 - the metric families
    except ImportError as exc:
        raise RendezvousParameterError(
            "the web view and /metrics need the prometheus_client package, which is not "
            f"installed: {INSTALL_HINT}"
        ) from exc
    return prometheus_client


def render_metrics(collector: "MonitorCollector") -> tuple[bytes, str]:
    """The exposition of ``collector`` and its content type."""
    pc = require_prometheus()
    registry = pc.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return pc.generate_latest(registry), pc.CONTENT_TYPE_LATEST


class MonitorCollector:
    """A ``prometheus_client`` collector of a :class:`RunSource` (see the module docstring)."""

    def __init__(self, source: RunSource) -> None:
        self.source = source
        self._totals: dict[str, RunTotals] = {}
        self._lock = threading.Lock()  # scrapes may overlap: each run's totals fold once

    def collect(self) -> Iterator[Any]:
        pc = require_prometheus()
        core = pc.core
        snapshot = self.source.server()
        if snapshot is not None:
            yield from _server_families(core, snapshot)
        statuses: list[tuple[str, RunStatus, RunTotals]] = []
        with self._lock:
            try:
                run_ids = self.source.run_ids()
            except SourceUnavailable as exc:
                log.warning("/metrics: %s", exc)
                run_ids = []
            else:  # the totals of runs gone (deleted from the store) go with them
                self._totals = {run: self._totals[run] for run in run_ids if run in self._totals}
            up = core.GaugeMetricFamily(
                "rdzv_monitor_store_up", "1 if the monitor read the runs' store at this scrape")
            failed = False
            for run_id in run_ids:
                try:
                    status = self.source.status(run_id)
                    totals = self._totals.setdefault(run_id, RunTotals())
                    history = self.source.new_events(run_id, totals.read)
                except SourceUnavailable as exc:
                    log.warning("/metrics: %s", exc)
                    failed = True
                    break
                totals.read = history
                totals.add(history.events, len(history.corrupt))
                statuses.append((run_id, status, totals))
            up.add_metric([], 0 if failed else 1)
            yield up
        yield from _run_families(core, statuses)


def _server_families(core: Any, m: ServerMetricsSnapshot) -> Iterator[Any]:
    stats = m.stats
    for name, key, doc in (
        ("connections", "connections", "Client connections open now"),
        ("sessions", "sessions", "Client sessions now (with or without a connection)"),
        ("keys", "keys", "Keys stored now"),
        ("buffered_bytes", "buffered_bytes", "Bytes buffered for clients (requests and answers)"),
        ("memory_budget_bytes", "memory_budget", "The server's memory budget (--memory-budget)"),
    ):
        yield core.GaugeMetricFamily(f"rdzv_store_{name}", doc, value=stats.get(key, 0))
    for name, value, doc in (
        ("connections_accepted", m.connections_accepted, "Client connections accepted"),
        ("sessions_expired", m.sessions_expired,
         "Sessions ended by their ttl (a silent client, or one that did not come back)"),
        ("shed_connections", stats.get("shed_connections", 0),
         "Connections dropped to stay within the memory budget"),
    ):
        yield core.CounterMetricFamily(f"rdzv_store_{name}", doc, value=value)
    requests = core.CounterMetricFamily(
        "rdzv_store_requests", "Requests handled, by operation", labels=["op"])
    for op, count in sorted(m.requests.items()):
        requests.add_metric([op], count)
    yield requests
    yield _histogram(core, "rdzv_store_request_duration_seconds",
                     "Seconds from reading a request to sending its answer (after the write-ahead "
                     "log's flush); waiting requests and quiet sets are not timed",
                     [([], m.request_latency)])
    if m.wal_bytes is not None and m.wal_fsync is not None:
        yield core.CounterMetricFamily(
            "rdzv_store_wal_written_bytes", "Bytes appended to the write-ahead log",
            value=m.wal_bytes)
        yield _histogram(core, "rdzv_store_wal_fsync_duration_seconds",
                         "Seconds each fsync of the write-ahead log took", [([], m.wal_fsync)])


def _run_families(core: Any, runs: list[tuple[str, "RunStatus", RunTotals]]) -> Iterator[Any]:
    gauges = {
        name: core.GaugeMetricFamily(f"rdzv_run_{name}", doc, labels=["run"])
        for name, doc in (
            ("round", "The run's last formed round (-1: none yet)"),
            ("world_size_nodes", "Nodes in the run's last formed round"),
            ("alive_nodes", "Members of the last round whose liveness key still exists"),
            ("waiting_nodes", "Nodes waiting to join the next round (spares included)"),
            ("spare_nodes", "Nodes waiting that cannot join: the run is at its maximum size"),
            ("closed", "1 once the run is closed"),
        )
    }
    rounds = core.CounterMetricFamily("rdzv_run_rounds_formed", "Rounds formed, by cause",
                                      labels=["run", "cause"])
    events = core.CounterMetricFamily("rdzv_run_events", "Events recorded, by kind",
                                      labels=["run", "kind"])
    failures = core.CounterMetricFamily("rdzv_run_worker_failures", "Workers that failed",
                                        labels=["run"])
    fallbacks = core.CounterMetricFamily(
        "rdzv_run_restart_fallbacks", "Rounds that restarted every worker instead of changing "
        "in-process, by cause", labels=["run", "cause"])
    corrupt = core.GaugeMetricFamily(
        "rdzv_run_history_corrupt_records", "Records of the history that cannot be read (skipped)",
        labels=["run"])
    node_gauges = {
        name: core.GaugeMetricFamily(f"rdzv_node_{name}", doc, labels=["run", "group_rank", "host"])
        for name, doc in (
            ("step_seconds", "Seconds per step of the node's workers (as of its last sign of life)"),
            ("work_seconds", "Of a step: the node's own work (the rest waits for the other nodes)"),
            ("straggler", "1 while the node is flagged as a straggler"),
        )
    }
    formation: list[tuple[list[str], HistogramSnapshot]] = []
    pauses: list[tuple[list[str], HistogramSnapshot]] = []
    for run_id, status, totals in runs:
        for member in status.members:
            labels = [run_id, str(member.rank), member.host or ""]
            if member.step_time is not None:
                node_gauges["step_seconds"].add_metric(labels, member.step_time)
            if member.compute is not None:
                node_gauges["work_seconds"].add_metric(labels, member.compute)
            node_gauges["straggler"].add_metric(labels, int(member.straggler is not None))
        values = {
            "round": -1 if status.round is None else status.round,
            "world_size_nodes": status.world_size,
            "alive_nodes": sum(1 for m in status.members if m.alive),
            "waiting_nodes": status.waiting,
            "spare_nodes": status.spares,
            "closed": int(status.closed),
        }
        for name, value in values.items():
            gauges[name].add_metric([run_id], value)
        for cause, count in sorted(totals.rounds.items()):
            rounds.add_metric([run_id, cause], count)
        for kind, count in sorted(totals.events.items()):
            events.add_metric([run_id, kind], count)
        failures.add_metric([run_id], totals.worker_failures)
        for cause, count in sorted(totals.fallbacks.items()):
            fallbacks.add_metric([run_id, cause], count)
        corrupt.add_metric([run_id], totals.corrupt)
        formation.append(([run_id], totals.formation.snapshot()))
        pauses.extend(([run_id, cause], h.snapshot()) for cause, h in sorted(totals.pauses.items()))
    yield from gauges.values()
    yield from node_gauges.values()
    yield from (rounds, events, failures, fallbacks, corrupt)
    yield _histogram(core, "rdzv_run_round_formation_seconds",
                     "Seconds each round took to form", formation, ["run"])
    yield _histogram(core, "rdzv_run_training_pause_seconds",
                     "Seconds training paused for each change, by its cause", pauses,
                     ["run", "cause"])


def _histogram(core: Any, name: str, doc: str,
               series: list[tuple[list[str], HistogramSnapshot]],
               labels: list[str] | None = None) -> Any:
    family = core.HistogramMetricFamily(name, doc, labels=labels or [])
    for values, snap in series:
        buckets = [(_le(bound), count) for bound, count in snap.cumulative()]
        family.add_metric(values, buckets, snap.sum)
    return family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))
