"""TEMPORARY stand-in for rdzv.rendezvous._history (branch hist), replaced at the merge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..store import Store


@dataclass(frozen=True)
class RunEvent:
    seq: int
    time: float
    kind: str
    round: int | None
    node: str | None
    fields: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.time, "kind": self.kind, "round": self.round,
                "node": self.node, **self.fields}


@dataclass(frozen=True)
class EventLog:
    events: list[RunEvent] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    next_seq: int = 0


def read_events(store: Store, run_id: str, *, since_seq: int = 0) -> EventLog:
    return EventLog(next_seq=since_seq)
