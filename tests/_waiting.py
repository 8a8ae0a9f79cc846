"""Waiting in tests: poll a condition with a short backoff, bounded in time, failing by name."""

from __future__ import annotations

import time
from typing import Any, Callable


def eventually(
    condition: Callable[[], Any],
    within: float = 30.0,
    what: str = "the condition",
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """The first true value of ``condition()``; AssertionError naming ``what`` after ``within`` s.

    An exception of a type in ``ignoring`` (a server still away, say) counts as a false value;
    the last one is named in the AssertionError."""
    deadline = time.monotonic() + within
    delay = 0.01
    last: BaseException | None = None
    while True:
        try:
            value = condition()
        except ignoring as exc:
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not within {within:g} s: {what}" + (f" (last: {last!r})" if last else "")
            ) from last
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
