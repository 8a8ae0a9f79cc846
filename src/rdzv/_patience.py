"""How a wait that may last is told: once it has lasted a moment, a line saying what is retried,
why and until when; then a line every ``EVERY`` seconds, never one a second.

Used by the store clients' connection retries (the tcp store, etcd), where a refused connection
or a host name that does not resolve yet is retried until a deadline, since nodes and servers
start in any order.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

FIRST_AFTER = 1.0
"""Seconds a wait lasts before its first line: one that ends sooner is no news."""
EVERY = 10.0
"""Seconds between two lines about the same wait."""
NOTICE_AFTER = 0.3
"""Seconds a command's wait may last before it says what it waits for."""


@contextlib.contextmanager
def notice_if_slow(say: Callable[[str], None], text: str) -> Iterator[None]:
    """Run the block; ``say(text)`` once if it is still running after ``NOTICE_AFTER``."""
    timer = threading.Timer(NOTICE_AFTER, say, (text,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()



class Patience:
    """The lines of one wait for ``what`` until the monotonic ``deadline``."""

    def __init__(self, logger: logging.Logger, what: str, deadline: float,
                 first_after: float = FIRST_AFTER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger, self._what, self._deadline, self._clock = logger, what, deadline, clock
        self._start = clock()
        self._next = self._start + first_after
        self._failures = 0

    def failed(self, why: str) -> None:
        """A try failed because ``why``: say so if a line is due."""
        self._failures += 1
        now = self._clock()
        if now < self._next:
            return
        self._next = now + EVERY
        left = max(0.0, self._deadline - now)
        tries = f"{self._failures} tries in {now - self._start:.0f} s" if self._failures > 1 \
            else "first try"
        self._logger.warning("%s: %s (%s); retrying for up to %.0f s more", self._what, why,
                             tries, left)
