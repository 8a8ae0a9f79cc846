"""Waiting in tests: poll a condition with a short backoff, bounded in time, failing by name."""

from __future__ import annotations

import time
from typing import Any, Callable


def eventually(
    condition: Callable[[], Any], within: float = 30.0, what: str = "the condition"
) -> Any:
    """The first true value of ``condition()``; AssertionError naming ``what`` after ``within`` s."""
    deadline = time.monotonic() + within
    delay = 0.01
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:g} s: {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
