"""The store server's own numbers: plain counters and fixed-bucket histograms, cheap to keep.

The server counts as it goes (one list increment per request, one clock read per batch of
requests read together) and never imports a metrics library: :mod:`rdzv.monitor` reads a
:meth:`ServerMetrics.snapshot` from another thread at scrape time and exposes it to Prometheus.
Reads from another thread see each number whole (the GIL); a snapshot taken during a round of
the loop may be one request behind in one series and not in another, which a scrape tolerates.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Sequence

from ..kv import protocol as P

REQUEST_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
"""Upper bounds (seconds) of the request latency histogram's buckets."""
FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds (seconds) of the write-ahead log's fsync histogram's buckets."""


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram at one moment: ``counts[i]`` observations fell at or below ``bounds[i]``
    (and above the bound before it); ``counts[-1]``: above the last bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) for every bound and +Inf."""
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            out.append((bound, total))
        return out


class Histogram:
    """Observations counted in fixed buckets, with their sum (no lock: one writer thread)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)) or not bounds:
            raise ValueError(f"bucket bounds must be increasing and distinct, not {bounds!r}")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Count ``n`` observations of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum)


@dataclass(frozen=True)
class ServerMetricsSnapshot:
    """:class:`ServerMetrics` at one moment, with the gauges of :meth:`Core.stats`."""

    requests: dict[str, int]
    """Requests handled, by operation name (only those seen)."""
    request_latency: HistogramSnapshot
    wal_bytes: int | None
    """Bytes appended to the write-ahead log (None: the server keeps its data in memory)."""
    wal_fsync: HistogramSnapshot | None
    sessions_expired: int
    connections_accepted: int
    stats: dict[str, int]
    """``connections``, ``sessions``, ``keys``, the memory budget's numbers."""


class ServerMetrics:
    """What the server counts while it serves (written on the loop only)."""

    __slots__ = ("requests", "request_latency", "sessions_expired", "connections_accepted")

    def __init__(self) -> None:
        self.requests = [0] * 256
        """Requests handled, by opcode."""
        self.request_latency = Histogram(REQUEST_BUCKETS)
        """Seconds from reading a request to handing its answer to the socket (after the log's
        flush, with a write-ahead log); requests that wait (blocking get, wait, watch) are not
        timed: their time is the client's wait."""
        self.sessions_expired = 0
        """Sessions ended by their ttl: a silent client, or one that did not come back after a
        restart of the server or its connection shed."""
        self.connections_accepted = 0

    def snapshot(self, stats: dict[str, int], wal: Any = None) -> ServerMetricsSnapshot:
        """These numbers now, with ``stats`` and those of the write-ahead log ``wal`` (if any)."""
        counts = list(self.requests)
        return ServerMetricsSnapshot(
            requests={P.OP_NAMES.get(op, str(op)): n for op, n in enumerate(counts) if n},
            request_latency=self.request_latency.snapshot(),
            wal_bytes=wal.bytes_written if wal is not None else None,
            wal_fsync=wal.fsync_seconds.snapshot() if wal is not None else None,
            sessions_expired=self.sessions_expired,
            connections_accepted=self.connections_accepted,
            stats=dict(stats),
        )
