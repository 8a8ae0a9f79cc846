"""What ``rdzv run`` says while its round forms, with time moved by hand: a line every
``EVERY`` seconds of waiting, and the last call said the moment it begins (no sleeping: the
console reads the agent's clock). The rendezvous is a real one (the memory backend, two
handlers waiting in threads)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from _clock import ManualClock
from _waiting import eventually

from rdzv._patience import EVERY
from rdzv.agent._forming import Forming
from rdzv.errors import RendezvousClosedError
from rdzv.rendezvous import RendezvousParameters, get_rendezvous_handler


class Console:
    """The agent as the console of forming rounds sees it: its handler, limits, lines, clock."""

    def __init__(self, handler: Any, clock: ManualClock) -> None:
        self.handler, self.clock, self.lines = handler, clock, []
        self.config = SimpleNamespace(min_nodes=2, max_nodes=3)

    def say(self, message: str) -> None:
        self.lines.append(message)


def waiting(handler: Any) -> threading.Thread:
    def run() -> None:
        try:
            handler.next_rendezvous()
        except RendezvousClosedError:
            pass
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_line_every_interval_of_waiting_and_the_last_call_at_once() -> None:
    params = RendezvousParameters("memory", "forming-console", "job", 2, 3,
                                  last_call_timeout=30)
    first, second = get_rendezvous_handler(params), get_rendezvous_handler(params)
    threads = [waiting(first)]
    try:
        eventually(lambda: first.forming() == (1, None), 30, "the first node waits in the round")
        clock = ManualClock()
        console = Console(first, clock)
        forming = Forming(console)
        forming.begin()
        clock.advance(EVERY / 2)
        forming.tick(survivors=False)
        assert console.lines == []  # nothing new, and not yet due
        clock.advance(EVERY / 2)
        forming.tick(survivors=False)
        assert console.lines == [f"still waiting for nodes ({EVERY:.0f} s): 1 joined, 2 needed"]
        clock.advance(1)
        forming.tick(survivors=False)
        assert len(console.lines) == 1
        threads.append(waiting(second))  # min_nodes reached: the last call begins
        eventually(lambda: (first.forming() or (0, None))[1] is not None, 30, "the last call")
        clock.advance(1)  # only 2 s after the last line: said at once, being news
        forming.tick(survivors=True)
        assert console.lines[1].startswith(
            f"the survivors wait for enough nodes to re-form ({EVERY + 2:.0f} s: 2 joined (min 2 "
            "reached); the last call waits ") and "for up to 3 (--rdzv-conf last_call_timeout=" \
            "SECONDS)); training resumes in-process then" in console.lines[1], console.lines
        clock.advance(1)
        forming.tick(survivors=True)
        assert len(console.lines) == 2  # the last call is said once
    finally:
        first.set_closed()
        for thread in threads:
            thread.join(30)
        for handler in (first, second):
            handler.shutdown()
    assert not any(thread.is_alive() for thread in threads)
