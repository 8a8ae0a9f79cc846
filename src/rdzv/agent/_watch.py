"""What a node watches in the background, each on a thread of its own, reported as events of
``_protocol.py`` on the agent's queue: its round's membership, the round's control keys while a
transition runs, (leaving) how the others moved on, and (signalled) whether the store is still up.

Each watcher blocks on the store through its own client, so no watcher holds up another or the
agent's own calls: the membership through the rendezvous's second client
(:meth:`RendezvousHandler.membership`), the control keys through a client of their own. Every
wait is a bounded slice; a stopped watcher ends after its current slice and posts nothing more.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from typing import Any, Callable

from .._clock import Clock
from ..errors import RendezvousError, SessionExpiredError, StoreConnectionError
from ..rendezvous import (
    AGENT_ABANDON,
    AGENT_CTL,
    AGENT_DECISION,
    AGENT_DIR,
    AGENT_HINT,
    AGENT_LEAVING,
    AGENT_NEXT,
    AGENT_NODES,
    AGENT_READY,
    AGENT_RESTARTING,
    RendezvousHandler,
)
from ..store import Store
from ._protocol import (
    Abandoned,
    AllFinished,
    Changed,
    Decided,
    Expired,
    FormFailed,
    Hinted,
    NextSeen,
    RecordsIn,
    Unreadable,
)
from ._records import NodeRecord, loads_decision, loads_record

logger = logging.getLogger(__name__)

WAIT_SLICE = 0.25
"""Longest single blocking call of a watcher."""


class Watcher:
    """A daemon thread running ``body(stopped)`` until it returns or is stopped."""

    def __init__(self, name: str, body: Callable[[threading.Event], None]) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(body,), daemon=True, name=name)
        self._thread.start()

    def _run(self, body: Callable[[threading.Event], None]) -> None:
        try:
            body(self._stopped)
        except Exception:  # a bug: log it, the node's deadlines bound what it waited for
            logger.exception("a watcher of the rendezvous failed")

    def stop(self) -> None:
        self._stopped.set()


def watch_membership(handler: RendezvousHandler, store: Store, gen: int,
                     post: Callable[[Any], None], heartbeat: Callable[[int], None], every: float,
                     wait_slice: float, clock: Clock) -> Callable[[threading.Event], None]:
    """A watcher body posting :class:`Changed` each time round ``gen``'s membership differs
    from what it last posted (edge-triggered), and refreshing this node's sign of life every
    ``every`` seconds of ``clock`` (``heartbeat(spares)``: the spares seen waiting last).
    ``store`` is the round's store (for the count of leaving members)."""

    def body(stopped: threading.Event) -> None:
        since, last, beat, spares = 0, None, clock.monotonic(), 0
        while not stopped.is_set():
            try:
                if clock.monotonic() - beat >= every:
                    beat = clock.monotonic()
                    heartbeat(spares)
                seen = handler.membership(since, wait_slice)
                if seen is None:  # a backend without counts: any change is news
                    if handler.wait_for_membership_change(wait_slice):
                        post(Changed(gen, lost=1))
                        return
                    continue
                view, since = seen
                if stopped.is_set():
                    return
                spares = max(0, view.waiting - view.moved)
                leaving = store.count_keys(AGENT_LEAVING) if view.alive < view.world_size else 0
                change = Changed(gen, lost=max(0, view.world_size - view.alive - leaving),
                                 leaving=leaving, waiting=view.newcomers, moved=view.moved,
                                 closed=view.closed or view.newer_round_sealed)
                if not view.changed:
                    last = None  # back to calm: the next change is news again
                elif change != last:
                    last = change
                    post(change)
            except SessionExpiredError as exc:  # this node was paused past its ttl: its own
                post(Expired(str(exc)))         # keys are gone, it is not one of the lost
                return
            except StoreConnectionError as exc:  # unreachable for the store's whole timeout:
                if not stopped.is_set():        # gone (with the node that hosted it?)
                    post(FormFailed("store", str(exc)))
                return
            except (RendezvousError, OSError) as exc:
                if stopped.is_set():
                    return
                logger.warning("cannot watch the rendezvous membership: %s (retrying in "
                               "%.3g s)", exc, wait_slice)
                stopped.wait(wait_slice)

    return body


def watch_round(store: Store, gen: int, post: Callable[[Any], None], coordinator: bool,
                nodes: int, timeout: float, clock: Clock) -> Callable[[threading.Event], None]:
    """A watcher body for a transition's round ``gen``: posts the hint, the decision and abandon
    marks as they appear; the coordinator also gets every record once all are final, or what
    there is after ``timeout`` seconds of ``clock`` (:class:`RecordsIn`), or once all are
    written if a final one asks for a restart. Non-coordinators watch the control
    keys only (O(1) wake-ups); the coordinator watches the records too. The keys are read again
    only once the watch saw them change: a slice without a change costs one watch request (N
    nodes waiting T seconds for a decision: N x T / WAIT_SLICE watches, not 5 times that)."""

    def body(stopped: threading.Event) -> None:
        path = AGENT_DIR if coordinator else AGENT_CTL
        deadline = clock.monotonic() + timeout
        since, hinted, decided, records_sent, abandoned = 0, False, False, False, 0
        while not stopped.is_set():
            try:
                reads = store.read_many([AGENT_DECISION, AGENT_HINT], [
                    AGENT_READY, AGENT_RESTARTING, AGENT_NODES, AGENT_ABANDON] if coordinator
                    else [AGENT_ABANDON], revisions=[path])
            except RendezvousError as exc:
                if stopped.is_set():
                    return
                logger.warning("cannot read the round's decision: %s", exc)
                stopped.wait(WAIT_SLICE)
                continue
            if stopped.is_set():
                return
            raw_hint, raw = reads.values[AGENT_HINT], reads.values[AGENT_DECISION]
            if raw_hint is not None and not hinted:
                hinted = True
                post(Hinted.read(gen, raw_hint))
            if raw is not None and not decided:
                decided = True
                try:
                    post(Decided(gen, loads_decision(AGENT_DECISION, raw)))
                except RendezvousError as exc:
                    post(Unreadable(gen, f"the round's decision cannot be read: {exc}"))
            if reads.counts[AGENT_ABANDON] > abandoned:
                abandoned = reads.counts[AGENT_ABANDON]
                post(Abandoned(gen))
            timed_out = clock.monotonic() >= deadline
            restart = coordinator and reads.counts[AGENT_RESTARTING] > 0 and \
                reads.counts[AGENT_NODES] >= nodes  # (a restart waits for no settling)
            if coordinator and not decided and not records_sent and (
                    reads.counts[AGENT_READY] >= nodes or timed_out or restart):
                records_sent = True
                post(RecordsIn(gen, read_records(store, nodes), timed_out))
            since = max(since, reads.revisions[path])
            waiting = coordinator and not records_sent
            while not stopped.is_set():  # a slice that saw no change needs no read: watch on
                remaining = deadline - clock.monotonic() if waiting else WAIT_SLICE
                try:
                    if store.watch(path, since, max(0.0, min(WAIT_SLICE, remaining))) > since:
                        break
                except RendezvousError as exc:
                    logger.warning("cannot watch the round's decision: %s", exc)
                    stopped.wait(WAIT_SLICE)
                    break
                if waiting and clock.monotonic() >= deadline:
                    break  # the coordinator's wait for the records is over

    return body


def read_records(store: Store, nodes: int) -> dict[int, NodeRecord | None]:
    """Every node's record (None: missing or malformed, said in the log)."""
    found: dict[int, NodeRecord | None] = dict.fromkeys(range(nodes))
    for key, raw in store.list_keys(AGENT_NODES).items():
        try:
            rank = int(key.rsplit("/", 1)[1])
            if 0 <= rank < nodes:
                found[rank] = loads_record(key, raw)
        except (ValueError, RendezvousError) as exc:
            logger.error("ignoring an agent record: %s", exc)
    return found


def watch_next(store: Store, post: Callable[[Any], None], timeout: float,
               clock: Clock) -> Callable[[threading.Event], None]:
    """A leaving node: posts how the others moved on (:class:`NextSeen`, None after
    ``timeout`` seconds of ``clock``), from the key the next round's coordinator writes in this
    round."""

    def body(stopped: threading.Event) -> None:
        deadline = clock.monotonic() + timeout
        while not stopped.is_set():
            try:
                since = store.revision(AGENT_NEXT)
                raw = store.try_get(AGENT_NEXT)
                if raw is not None:
                    post(NextSeen(loads_decision(AGENT_NEXT, raw)))
                    return
                remaining = deadline - clock.monotonic()
                if remaining <= 0:
                    post(NextSeen(None))
                    return
                store.watch(AGENT_NEXT, since, min(WAIT_SLICE, remaining))
            except RendezvousError as exc:
                logger.warning("cannot learn whether the others moved on: %s", exc)
                if stopped.wait(WAIT_SLICE) or clock.monotonic() >= deadline:
                    post(NextSeen(None))
                    return

    return body


def watch_finish(done: Callable[[], bool], gen: int, post: Callable[[Any], None],
                 wait_slice: float) -> Callable[[threading.Event], None]:
    """Posts :class:`AllFinished` once ``done()`` holds (every node of the round finished)."""

    def body(stopped: threading.Event) -> None:
        while not stopped.wait(wait_slice):
            try:
                if done():
                    post(AllFinished(gen))
                    return
            except RendezvousError as exc:
                logger.warning("cannot tell whether every node finished: %s", exc)

    return body


STORE_PROBE_EVERY = 0.5
"""Seconds between two connection attempts of :func:`watch_store_up`."""
STORE_PROBE_REFUSALS = 2
"""Refused connections in a row that make the store gone."""


def watch_store_up(host: str, port: int, post: Callable[[Any], None]
                   ) -> Callable[[threading.Event], None]:
    """A watcher body posting ``FormFailed("store")`` once connections to the store server at
    ``host:port`` are refused :data:`STORE_PROBE_REFUSALS` times in a row: nothing listens
    there any more (its process ended), which the store client would only conclude after its
    whole timeout. For a node asked to leave: when the node that hosted the store was stopped
    with it (Slurm's scancel of a whole job), there is nothing left to leave gracefully."""

    def body(stopped: threading.Event) -> None:
        refused = 0
        while not stopped.wait(STORE_PROBE_EVERY):
            try:
                socket.create_connection((host, port), timeout=STORE_PROBE_EVERY).close()
                refused = 0
            except OSError as exc:
                refused = refused + 1 if exc.errno == errno.ECONNREFUSED else 0
            if refused >= STORE_PROBE_REFUSALS:
                post(FormFailed("store", f"nothing listens at {host}:{port} any more"))
                return

    return body


class Watches:
    """A node's watchers: its round's membership (with its sign of life), the round's control
    keys while a transition runs, and the one-off ones (a leave, the finish). The round watchers
    read through clients of their own: two, alternating, so that a stopped watcher's last slice
    never holds up the next round's."""

    def __init__(self, handler: RendezvousHandler) -> None:
        self._handler = handler
        self._membership: Watcher | None = None
        self._round: Watcher | None = None
        self._others: list[Watcher] = []
        self._clients: list[Store | None] = [None, None]

    def membership(self, gen: int, body: Callable[[threading.Event], None]) -> None:
        """Watch round ``gen``'s membership with ``body`` (unless a watcher already does)."""
        if self._membership is None:
            self._membership = Watcher(f"rdzv-membership-{gen}", body)

    def round(self, gen: int, store: Store, body: Callable[[Store], Callable[
            [threading.Event], None]]) -> None:
        """Watch round ``gen``'s control keys with ``body(round store)`` (``store`` where the
        backend has no second client), unless a watcher already does."""
        if self._round is not None:
            return
        open_client = getattr(self._handler, "open_client", None)
        if open_client is not None:
            if self._clients[gen % 2] is None:
                self._clients[gen % 2] = open_client()
            client = self._clients[gen % 2]
            if client is not None:
                store = self._handler.round_store(client)  # type: ignore[attr-defined]
        self._round = Watcher(f"rdzv-round-{gen}", body(store))

    def add(self, name: str, body: Callable[[threading.Event], None]) -> None:
        self._others.append(Watcher(name, body))

    def stop_round(self) -> None:
        """Stop the membership and control-key watchers (a change seen from now on is news
        again: they are edge-triggered)."""
        for watcher in (self._membership, self._round):
            if watcher is not None:
                watcher.stop()
        self._membership = self._round = None

    def close(self) -> None:
        self.stop_round()
        for watcher in self._others:
            watcher.stop()
        for client in self._clients:
            if client is not None:
                client.close()
