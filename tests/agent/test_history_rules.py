"""The agent's part of the history as tables (``rdzv/agent/_history.py``): who was lost and how,
a worker failure's fields, the session ttl and the pace of the signs of life."""

from __future__ import annotations

from typing import Any

import pytest

from rdzv.agent._errors import WorkerError, WorkerFailure
from rdzv.agent._history import failure_fields, heartbeat_every, lost_members


@pytest.mark.parametrize("alive, seen, now, expected", [
    ({0: {}, 1: {}, 2: {}}, {0: 9.0, 1: 9.0, 2: 9.0}, 10.0, {}),
    # rank 2 vanished 0.4 s after its last sign of life: killed
    ({0: {}, 1: {}}, {0: 9.9, 1: 9.9, 2: 9.6}, 10.0, {2: ("n2", "connection_lost", 0.4)}),
    # rank 1 vanished after a session ttl of silence: hung
    ({0: {}, 2: {}}, {0: 9.9, 1: -5.5, 2: 9.9}, 10.0, {1: ("n1", "heartbeat_missed", 15.5)}),
    # never seen (no lasting sign of life): cannot tell
    ({0: {}}, {0: 9.9}, 10.0, {1: ("n1", "lost", None), 2: ("n2", "lost", None)}),
])
def test_lost_members(alive: dict[int, Any], seen: dict[int, float], now: float,
                      expected: dict[int, tuple[str, str, float | None]]) -> None:
    nodes = {0: "n0", 1: "n1", 2: "n2"}
    assert lost_members(3, alive, seen, nodes, now, 15.0) == expected


@pytest.mark.parametrize("ttl, every", [(15.0, 5.0), (60.0, 5.0), (3.0, 1.0), (0.9, 0.3)])
def test_heartbeat_every_is_three_per_ttl_at_least(ttl: float, every: float) -> None:
    assert heartbeat_every(ttl) == pytest.approx(every)


def failure(code: int, message: str | None) -> WorkerFailure:
    error = WorkerError(message, "Traceback ...", None) if message is not None else None
    return WorkerFailure(global_rank=5, local_rank=1, role="default", host="h", pid=42,
                         exit_code=code, time=1.0, log_files=(), error=error)


@pytest.mark.parametrize("code, message, fields", [
    (1, "ValueError: boom\n  more", {"exit_code": 1, "error": "ValueError: boom"}),
    (-9, None, {"signal": "SIGKILL"}),
    (-15, "", {"signal": "SIGTERM"}),
    (2, "x" * 500, {"exit_code": 2, "error": "x" * 200}),
])
def test_failure_fields(code: int, message: str | None, fields: dict[str, Any]) -> None:
    assert failure_fields(failure(code, message)) == {"rank": 5, "local_rank": 1, "pid": 42,
                                                      **fields}
