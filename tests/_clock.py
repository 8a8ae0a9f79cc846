"""A clock the test moves by hand (``rdzv._clock.Clock``): time passes only when told to."""

from __future__ import annotations


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1.7e9 + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
