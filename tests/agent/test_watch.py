"""watch_round's cost while nothing changes: a slice that saw no change reads nothing, so a node
waiting for its round's decision costs one watch request per slice, not a read of the round's
control keys each time (N waiting nodes, a transition of T seconds: N x T / WAIT_SLICE reads)."""

from __future__ import annotations

import threading
from typing import Any, Sequence

from _agents import wait_for
from _clock import ManualClock

from rdzv._clock import SYSTEM_CLOCK, Clock
from rdzv.agent._protocol import Decided, RecordsIn
from rdzv.agent._records import Decision, Kind, dumps_decision
from rdzv.agent._watch import WAIT_SLICE, watch_round
from rdzv.rendezvous import AGENT_DECISION, ready_key, record_key, restarting_key
from rdzv.store import HashStore, Reads, Timeout


class CountingStore(HashStore):
    """A HashStore that counts its read_many calls (one per read of the control keys) and the
    watch calls that returned (one per slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.watches = 0

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        try:
            return super().watch(path, since, timeout)
        finally:
            self.watches += 1

    def read_many(self, keys: Sequence[str] = (), counts: Sequence[str] = (),
                  revisions: Sequence[str] = (), lists: Sequence[str] = ()) -> Reads:
        self.reads += 1
        return super().read_many(keys, counts, revisions, lists)


def watching(store: CountingStore, coordinator: bool, timeout: float,
             clock: Clock = SYSTEM_CLOCK) -> tuple[list[Any], threading.Event]:
    """A round watcher on ``store`` in a thread of its own: (what it posted, its stop)."""
    posted: list[Any] = []
    stopped = threading.Event()
    body = watch_round(store, 1, posted.append, coordinator, 2, timeout, clock)
    threading.Thread(target=body, args=(stopped,), daemon=True).start()
    return posted, stopped


def test_a_waiting_node_reads_the_control_keys_only_when_they_changed() -> None:
    store = CountingStore()
    posted, stopped = watching(store, coordinator=False, timeout=60.0)
    try:
        wait_for(lambda: store.watches >= 4, 30 * WAIT_SLICE, "four slices without a change")
        assert store.reads == 1 and posted == []
        decision = Decision(Kind.STAY, "d1")
        store.set(AGENT_DECISION, dumps_decision(decision))
        wait_for(lambda: posted, 5.0, "the decision posted")
        assert posted == [Decided(1, decision)] and store.reads == 2
    finally:
        stopped.set()


def test_the_coordinator_gets_what_there_is_at_its_deadline_without_a_change() -> None:
    store, clock = CountingStore(), ManualClock()
    store.set(ready_key(0), b"1")  # one of two records final: the wait ends at the deadline
    posted, stopped = watching(store, coordinator=True, timeout=60.0, clock=clock)
    try:
        wait_for(lambda: store.watches >= 2, 30 * WAIT_SLICE, "two slices before the deadline")
        assert posted == []
        clock.advance(60.0)  # the deadline, by the node's clock
        wait_for(lambda: posted, 5.0, "the records posted at the coordinator's deadline")
        assert len(posted) == 1 and isinstance(posted[0], RecordsIn) and posted[0].timed_out
        assert posted[0].records == {0: None, 1: None} and store.reads == 2
    finally:
        stopped.set()


def test_the_coordinator_decides_a_restart_without_waiting_for_the_others_to_settle() -> None:
    """A final record that asks for a restart (a worker failed) lets the coordinator decide as
    soon as every record is written: the other node's workers, still starting in a group that
    cannot form any more, would keep its record from ever being final."""
    store, clock = CountingStore(), ManualClock()
    store.set(record_key(1), b"{}")  # written, not final: its workers still start
    posted, stopped = watching(store, coordinator=True, timeout=60.0, clock=clock)
    try:
        wait_for(lambda: store.watches >= 2, 30 * WAIT_SLICE, "two slices, one record")
        assert posted == []
        with store.batch():  # what write_record does for a final record asking for a restart
            store.set(record_key(0), b"{}")
            store.set(ready_key(0), b"1")
            store.set(restarting_key(0), b"1")
        wait_for(lambda: posted, 5.0, "the records posted before the deadline")
        assert isinstance(posted[0], RecordsIn) and not posted[0].timed_out
        assert set(posted[0].records) == {0, 1}
    finally:
        stopped.set()
