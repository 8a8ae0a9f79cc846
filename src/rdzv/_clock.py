"""Time as rdzv's protocols read it: a clock is handed to the code whose decisions depend on
time (the dynamic rendezvous's engine; the agent's node run, its console, its health checks
and its watchers of a transition's round; the TCP store client's keepalive), so that tests move
time instead of sleeping through it. Code that only bounds a real wait (a socket, a store call)
reads the system's clocks itself.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """The two clocks rdzv reads."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (intervals and deadlines)."""

    def time(self) -> float:
        """Seconds since the epoch (what is shown and recorded)."""


class _SystemClock:
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


SYSTEM_CLOCK: Clock = _SystemClock()
"""The machine's clocks."""
