"""The rules of planned membership changes, as tables (``rdzv/agent/_changes.py``)."""

from __future__ import annotations

import pytest

from rdzv.agent._changes import Change, Mode, choose_mode, classify_change, switch_step


@pytest.mark.parametrize(
    ("world_size", "alive", "leaving", "waiting", "expected"),
    [
        (2, 2, 0, 1, Change.PLANNED),   # a newcomer waits
        (3, 3, 1, 0, Change.PLANNED),   # a member announced its leave, still alive
        (3, 3, 1, 2, Change.PLANNED),   # leaving, and the others already moving on
        (3, 2, 0, 0, Change.LOST),      # a member's liveness is gone
        (3, 2, 1, 1, Change.LOST),      # a loss beside a planned change: the loss wins
        (2, 2, 0, 0, Change.LOST),      # nothing explains the change: re-form as before
        (1, 0, 0, 1, Change.LOST),
    ],
)
def test_classify_change(world_size: int, alive: int, leaving: int, waiting: int,
                         expected: Change) -> None:
    assert classify_change(world_size, alive, leaving, waiting) is expected


@pytest.mark.parametrize(
    ("restart_on_change", "member", "capable", "old_world", "expected"),
    [
        (False, True, 2, 2, Mode.IN_PROCESS),
        (False, True, 3, 2, Mode.IN_PROCESS),
        (False, True, 1, 2, Mode.RESTART),    # a node whose workers do not use the API
        (True, True, 2, 2, Mode.RESTART),     # --restart-on-change
        (False, False, 2, 2, Mode.RESTART),   # group rank 0 did not run in the old round
    ],
)
def test_choose_mode(restart_on_change: bool, member: bool, capable: int, old_world: int,
                     expected: Mode) -> None:
    assert choose_mode(restart_on_change, member, capable, old_world) is expected


@pytest.mark.parametrize(
    ("step", "step_time", "lead_seconds", "expected"),
    [
        (100, 0.064, 0.25, 100 + 2 + 4),   # 0.25 s is 4 steps of 64 ms
        (100, 1.0, 0.25, 103),             # long steps: two steps ahead, and one to hear of it
        (0, None, 0.25, 2),                # not measured yet
        (7, 0.0, 0.25, 9),
        (10, 1e-6, 0.25, 10 + 10_000),     # tiny steps: capped
    ],
)
def test_switch_step(step: int, step_time: float | None, lead_seconds: float,
                     expected: int) -> None:
    assert switch_step(step, step_time, lead_seconds) == expected
