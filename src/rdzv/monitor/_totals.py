"""A run's totals for ``/metrics``, folded from its recorded events (no I/O).

:class:`RunTotals` adds up what the events of a run say (rounds formed by cause, how long each
round took to form, how long training paused for each change, worker failures); the collector
(:mod:`._prometheus`) keeps one per run and folds in only the events recorded since its last
scrape (after ``seen_seq``), so a scrape reads the history once, not again and again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..server._metrics import Histogram

FORMATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (seconds) of the round formation histogram's buckets."""
PAUSE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
"""Upper bounds (seconds) of the training pause histogram's buckets."""
PAUSE_KINDS = ("training_paused", "switched_in_process", "recovered_in_process")
"""Events that say how long training paused (``pause_s``)."""
UNKNOWN = "unknown"


@dataclass
class RunTotals:
    """What a run's events add up to (see the module docstring)."""

    seen_seq: int = 0
    """The history read so far: the next read asks for the events after this one."""
    events: dict[str, int] = field(default_factory=dict)
    """Events seen, by kind."""
    rounds: dict[str, int] = field(default_factory=dict)
    """Rounds formed, by cause."""
    formation: Histogram = field(default_factory=lambda: Histogram(FORMATION_BUCKETS))
    pauses: dict[str, Histogram] = field(default_factory=dict)
    """Training pauses (seconds), by the cause of the change."""
    worker_failures: int = 0
    corrupt: int = 0
    """Records of the history that could not be read at the last read (reported, skipped)."""

    def add(self, events: Iterable[Any], corrupt: int = 0) -> None:
        """Fold in ``events`` (:class:`~rdzv.rendezvous.RunEvent`) and the count
        of ``corrupt`` records read with them."""
        seen = self.seen_seq
        for event in events:
            if event.seq <= seen:
                continue  # folded in already
            self.seen_seq = max(self.seen_seq, event.seq)  # (events come in the order they happened)
            kind = event.kind
            fields = event.fields
            self.events[kind] = self.events.get(kind, 0) + 1
            if kind == "round_formed":
                cause = _label(fields.get("cause"))
                self.rounds[cause] = self.rounds.get(cause, 0) + 1
                took = fields.get("formation_s")
                if _is_seconds(took):
                    self.formation.observe(took)
            elif kind == "worker_failed":
                self.worker_failures += 1
            if kind in PAUSE_KINDS and _is_seconds(fields.get("pause_s")):
                cause = _label(fields.get("cause", kind))
                pauses = self.pauses.get(cause)
                if pauses is None:
                    pauses = self.pauses[cause] = Histogram(PAUSE_BUCKETS)
                pauses.observe(fields["pause_s"])
        self.corrupt = corrupt  # (the reader reports every corrupt record at every read)


def _label(value: Any) -> str:
    return value if isinstance(value, str) and value else UNKNOWN


def _is_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
