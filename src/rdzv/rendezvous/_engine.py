"""The dynamic rendezvous handler: observes the store, applies the pure decisions, waits on changes.

The rules live in ``_decisions.py`` and the key layout in ``_layout.py``; this module only does
the I/O. A node in a forming round loops: read the round's control keys and O(1) counts, call
:func:`decide`, carry out the step, and wait on the store's change notification of the round's
``ctl/`` directory (``Store.watch``) until the step's wake-up time. Every wait is one blocking
``watch`` call bounded by the step's deadline and by the store's own operation timeout
(``read_timeout``), so a lost store surfaces as RendezvousConnectionError within about that
long, never as a hang. On a store without the ``watch`` capability (FileStore) that call is the
store's own bounded poll of the file (1 ms backing off to 50 ms).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Callable

from .._clock import SYSTEM_CLOCK, Clock
from ..errors import (RendezvousClosedError, RendezvousError, RendezvousTimeoutError,
                      SessionExpiredError)
from ..store import PrefixStore, Store
from ._api import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
from ._decisions import (
    Action,
    RoundRules,
    RoundView,
    Verdict,
    check_rank,
    decide,
    is_spare,
    join_deadline,
    join_timeout_message,
)
from ._history import DEFAULT_HISTORY_SIZE, EventWriter, RunEvent
from ._history_facts import encode_left_mark
from ._layout import (CLOSED_STATUS, NodeDescriptor, RunKeys, decode_status,
                      encode_node)
from ._node import KeyLedger, PortReservation, SideClient, new_node_id
from ._sealer import Sealer
from ._views import (
    Membership,
    MembershipView,
    RoundChanges,
    latest_sealed,
    membership_view,
    observe_round,
    read_outcome,
    store_wait,
)

logger = logging.getLogger(__name__)

HISTORY_DEFER = 1.0
"""Seconds a node waits for a round before its own deferred events (its arrival) are written:
a round that forms sooner has no history write competing with it; they go once the node
watches its round (``wait_for_membership_change``, ``num_nodes_waiting``) or shuts down."""


class DynamicRendezvousHandler(RendezvousHandler):
    """Rounds of nodes formed on any :class:`Store` with the ``ephemeral`` and ``listing``
    capabilities, with O(1) store operations and wake-ups per node and round.

    ``on_shutdown`` releases what the backend opened (its store client, a hosted server).
    ``query_store`` opens a second client for :meth:`num_nodes_waiting`, :meth:`is_closed` and
    :meth:`set_closed` while this node waits in a round, for stores whose client serves one
    call at a time (TCPStore): the queries then never wait behind the round's blocking watch.
    ``clock``: the time the round's decisions are taken at (the system's unless a test moves
    its own).
    """

    def __init__(
        self,
        store: Store,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        *,
        backend: str,
        local_addr: str | None = None,
        join_timeout: float = 600.0,
        last_call_timeout: float = 30.0,
        close_timeout: float = 30.0,
        history_size: int = DEFAULT_HISTORY_SIZE,
        node_order: int | None = None,
        on_shutdown: Callable[[], None] | None = None,
        query_store: Callable[[], Store] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        caps = store.capabilities
        if not (caps.ephemeral and caps.listing):
            raise ValueError(
                f"the dynamic rendezvous needs a store with ephemeral keys and listing; "
                f"{type(store).__name__} has {caps}"
            )
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}, {max_nodes}")
        self._store = store
        self._clock = clock
        self._keys = RunKeys(run_id)
        self._rules = RoundRules(min_nodes, max_nodes, float(last_call_timeout))
        self._backend = backend
        self._host = local_addr or socket.getfqdn()
        self._node_order = node_order
        self._join_timeout = float(join_timeout)
        self._close_timeout = float(close_timeout)
        self._on_shutdown = on_shutdown
        self._side = SideClient(store, query_store)
        self._node_id = new_node_id(self._host)
        self._member: Membership | None = None
        self._last_view: tuple[MembershipView, int] | None = None
        self._forming: tuple[int, float | None] | None = None
        """Of the round this node waits in: the nodes joined, and when its last call began
        (monotonic; None: fewer than min_nodes yet), as last observed."""
        """What :meth:`membership` read last (its keys all change with one under its path)."""
        self._port: PortReservation | None = None
        """The port this node offers as the bootstrap port, held until its next round."""
        self._keys_held = KeyLedger(store)
        self._lock = threading.Lock()
        self._spare = False
        """This node waits as a spare (the running round is full), as last observed."""
        self._history_size = history_size
        self.history = EventWriter(self._side.get, run_id, tag=self._node_id,
                                   limit=history_size)
        """The run's history, written in the background (the agent records its events too)."""
        self.closed_here = False
        """This node's :meth:`set_closed` closed the rendezvous (it was open until then)."""
        self._sealer = Sealer(store, self._keys, self._rules, self._node_id,
                              fence=caps.conditional, history=history_size > 0)

    # -- RendezvousHandler ----------------------------------------------------------------------
    def get_backend(self) -> str:
        return self._backend

    def get_run_id(self) -> str:
        return self._keys.run_id

    @property
    def node_id(self) -> str:
        return self._node_id

    def is_closed(self) -> bool:
        return self._query().try_get(self._keys.closed) is not None

    def set_closed(self) -> None:
        keys, store = self._keys, self._query()
        me = self._node_id.encode()
        self.closed_here = store.compare_set(keys.closed, b"", me) == me
        forming = latest_sealed(store, self._keys) + 1
        for _ in range(100):  # a racing seal moves the forming round on; bounded anyway
            current = store.compare_set(keys.status(forming), b"", CLOSED_STATUS)
            if current == CLOSED_STATUS:
                break
            forming += 1
        logger.info("rendezvous %s closed by %s", keys.run_id, self._node_id)

    def num_nodes_waiting(self) -> int:
        store, member = self._query(), self._member
        if member is None:
            self.history.release()  # a monitoring call: this node's deferred events can go
            return store.count_keys(self._keys.nodes(latest_sealed(store, self._keys) + 1))
        return self._view(store, 0, 0.0, "num_nodes_waiting()")[0].nodes_waiting

    def round_changes(self) -> RoundChanges:
        """The nodes waiting and the members lost or left, in one read through this node's own
        store session: if it expired (the node was paused past its ttl and the others took it
        for gone), the node forgets it as :meth:`next_rendezvous` does and counts itself
        lost; it joins its next round as a new node."""
        if self._member is None:
            return RoundChanges(waiting=self.num_nodes_waiting(), lost=0)
        try:
            view, _ = self._view(self._store, 0, 0.0, "round_changes()")
        except SessionExpiredError as exc:
            with self._lock:
                self._forget_session(exc)
            return RoundChanges(waiting=0, lost=1)
        return RoundChanges(waiting=view.nodes_waiting, lost=view.lost)

    def is_spare(self) -> bool:
        return self._spare

    def forming(self) -> tuple[int, float | None] | None:
        """While this node waits for a round to form: the nodes joined so far and the seconds
        left in the last call (None: min_nodes not reached yet), as last observed."""
        forming = self._forming
        if forming is None:
            return None
        joined, armed_since = forming
        if armed_since is None:
            return joined, None
        return joined, max(0.0, armed_since + self._rules.last_call_timeout - self._clock.monotonic())

    def record_event(self, kind: str, **fields: object) -> RunEvent | None:
        """Record an event of this node in the run's history, in the background (never fails:
        a store that refuses it loses the event, not the run). ``round`` defaults to this
        node's last round."""
        member = self._member
        fields.setdefault("round", member.round if member is not None else None)
        return self.history.record(kind, node=self._node_id, **fields)  # type: ignore[arg-type]

    def report_left(self, reasons: dict[str, str]) -> None:
        """Say why members (node id -> leave reason) of this node's round are not coming back,
        for the next round's ``round_formed`` event; a store error is logged, not raised."""
        member = self._member
        if member is None or not reasons or self._history_size <= 0:
            return
        try:
            with self._store.batch():
                for node_id, reason in reasons.items():
                    self._store.set(self._keys.left(member.round + 1, node_id),
                                    encode_left_mark(reason))
        except RendezvousError as exc:
            logger.warning("rendezvous %s: cannot record why %s left: %s", self._keys.run_id,
                           ", ".join(reasons), exc)

    def next_rendezvous(self) -> RendezvousInfo:
        with self._lock:
            return self._next_rendezvous()

    def wait_for_membership_change(self, timeout: float) -> bool:
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        deadline = self._clock.monotonic() + timeout
        view, since = self._view(self._store, 0, 0.0, "wait_for_membership_change()")
        while not view.changed:
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False
            view, since = self._view(self._store, since, remaining,
                                     "wait_for_membership_change()")
        return True

    def membership(self, since: int = 0, timeout: float = 0.0) -> tuple[MembershipView, int]:
        """This member's round as seen now, and the revision to pass as ``since`` next time:
        with ``since``, first waits (at most ``timeout`` s, one store timeout) until something
        changed after it. Through the second client, so that a watcher never holds up the
        round's own calls (or ``next_rendezvous``)."""
        return self._view(self._side.get(), since, timeout, "membership()")

    def _view(self, store: Store, since: int, seconds: float,
              caller: str) -> tuple[MembershipView, int]:
        member = self._member
        if member is None:
            raise RendezvousError(f"{caller} needs a completed round: call next_rendezvous() "
                                  "first")
        self.history.release()  # the round is formed: this node's deferred events can go now
        path = self._keys.round(member.round + 1)
        last = self._last_view
        if since:
            revision = store.watch(path, since, store_wait(self._store, seconds))
            if revision <= since and last is not None and last[1] == since and \
                    last[0].round == member.round:
                return last  # nothing changed: no read (a watcher polls this for hours)
        self._last_view = membership_view(store, self._keys, self._rules, member, path)
        return self._last_view

    def round_store(self, client: Store) -> Store:
        """The store of this node's current round (as ``next_rendezvous`` returned it) through
        ``client``, a client from :meth:`open_client`."""
        member = self._member
        if member is None:
            raise RendezvousError("round_store() needs a completed round")
        return PrefixStore(self._keys.user(member.round), client)

    def open_client(self) -> Store | None:
        """A new client of the run's store for a caller that blocks on it (it closes it), or
        None when this node's client serves concurrent calls (etcd, file)."""
        return self._side.opener() if self._side.opener is not None else None

    def announce_leaving(self) -> bool:
        """Withdraw this member's liveness in the next round (its ``expect`` key): the others
        see the change at once and seal the next round as soon as every other member is back,
        while this node's current round goes on. It must not join again afterwards."""
        member = self._member
        if member is None:
            return False
        self.report_left({self._node_id: "graceful_leave"})
        self.record_event("node_leaving")  # (stamped before the others can seal without it)
        self._store.delete_key(self._keys.expect(member.round + 1, self._node_id))
        logger.info("rendezvous %s: %s leaves after round %d", self._keys.run_id, self._node_id,
                    member.round)
        return True

    def shutdown(self) -> bool:
        """Leave: delete this node's liveness keys (peers see it at once), release the backend.

        Bounded by ``close_timeout``: with the store gone, leaving gives up rather than waiting
        out the store's own timeout (the session's ephemeral keys expire on the server anyway).
        """
        for store in (self._store, self._side.opened):  # (the history writes through the second)
            if store is not None:
                store.set_timeout(min(self._close_timeout, store.timeout.total_seconds()))
        self.history.close(min(2.0, self._close_timeout))
        try:
            # Another thread joining a round through this node's client, which serves one call
            # at a time, holds it in its watch: the backend's close below cuts the watch short
            # and ends the session, and with it the keys written for the round (ephemeral); the
            # garbage of earlier rounds (plain keys) goes through the second client, if open.
            busy = (self._lock.locked() and self._side.opener is not None
                    and self._on_shutdown is not None)
            if not busy:
                self._keys_held.leave(self._query())
            elif self._side.opened is not None:
                self._keys_held.collect(self._side.opened)
            self._member = None
            return True
        except RendezvousError as exc:
            logger.warning("rendezvous %s: leaving failed: %s", self._keys.run_id, exc)
            return False
        finally:
            if self._port is not None:
                self._port.release()
                self._port = None
            self._side.close()
            if self._on_shutdown is not None:
                self._on_shutdown()

    # -- joining ----------------------------------------------------------------------------------
    def _next_rendezvous(self) -> RendezvousInfo:
        deadline = self._clock.monotonic() + self._join_timeout
        previous = self._member
        # A member goes straight to the round after its own; a newer one makes it late there.
        round_ = previous.round + 1 if previous else latest_sealed(self._store, self._keys) + 1
        if previous is None:  # written once the round is formed, or the node waits a while
            self.record_event("node_waiting", round=round_, host=self._host, pid=os.getpid(),
                              defer=True)
        lapsed = False
        while True:
            try:
                info = self._join_round(round_, previous, deadline)
            except SessionExpiredError as exc:
                if lapsed:
                    raise
                lapsed = True
                self._forget_session(exc)
                round_, previous = latest_sealed(self._store, self._keys) + 1, None
                continue
            if info is not None:
                return info
            round_, previous = max(round_, latest_sealed(self._store, self._keys)) + 1, None

    def _join_round(
        self, r: int, previous: Membership | None, deadline: float
    ) -> RendezvousInfo | None:
        store, keys, me = self._store, self._keys, self._node_id
        node = NodeDescriptor(
            me, self._host, os.getpid(), self._reserve_port(), previous.rank if previous else None,
            round(self._clock.time(), 6), self._node_order,
        )
        writes = {keys.expect(r + 1, me): b"1", keys.node(r, me): encode_node(node)}
        if previous is not None:
            writes[keys.back(r, me)] = b"1"
        # A member coming back keeps its liveness in this round until the round is sealed.
        self._keys_held.joining(writes, [keys.expect(r, me)] if previous is not None else [])
        with store.batch():  # the writes travel with the first look at the round
            for key, value in writes.items():
                store.set(key, value, ephemeral=True)
            first_look: tuple[RoundView, int] | None = observe_round(self._store, self._keys, self._rules, r)
        rank_key, status_key = keys.rank(r, me), keys.status(r)
        started = self._clock.monotonic()
        armed_since: float | None = None
        since = 0
        woken = False
        self._forming = None
        while True:
            if woken:  # after a seal attempt: one read tells a member everything
                reads = store.read_many([rank_key, status_key])
                if reads.values[rank_key] is not None:
                    done, info = self._collect(r, reads.values[rank_key],
                                               reads.values[status_key], previous)
                    if done:
                        return info
            view, seen = first_look or observe_round(self._store, self._keys, self._rules, r)
            first_look = None
            since = max(since, seen)
            now = self._clock.monotonic()
            deadline = join_deadline(view, self._rules, now, deadline, self._join_timeout)
            if is_spare(view, self._rules) != self._spare:
                self._spare = not self._spare
                if self._spare:
                    logger.info("rendezvous %s: %s waits as a spare for round %d",
                                keys.run_id, self._node_id, r)
                    self.record_event("spare_waiting", round=r, max_nodes=self._rules.max_nodes)
            step = decide(view, self._rules, now, deadline, armed_since)
            armed_since = step.armed_since
            self._forming = (view.alive, armed_since)
            woken = False
            if step.action is Action.CLOSED:
                self._keys_held.leave()
                raise RendezvousClosedError(f"the rendezvous of run {keys.run_id!r} is closed")
            if step.action is Action.TIMEOUT:
                self._keys_held.leave()
                raise RendezvousTimeoutError(join_timeout_message(
                    view, self._rules, r, keys.run_id, self._join_timeout))
            if step.action is Action.ARM:
                store.compare_set(keys.armed(r), b"", b"1")
            elif step.action is Action.SEAL:
                attempt = self._sealer.try_seal(r)
                self._keys_held.consumed(attempt.left_marks)
                if attempt.mine is not None:  # this node sealed the round: it knows its rank
                    return self._collect(r, *attempt.mine, previous)[1]
                if not attempt.held:
                    self._sealer.wait(r, deadline - self._clock.monotonic(), self._watch)
                woken = True
            elif step.action is Action.COLLECT:
                reads = store.read_many([rank_key, status_key])
                done, info = self._collect(r, reads.values[rank_key], reads.values[status_key],
                                           previous)
                if done:
                    return info
            else:
                self._keys_held.collect()  # while idle
                if now - started > HISTORY_DEFER:
                    self.history.release()
                if self._spare:
                    # A spare's wait ends with the run (the store may go with the last member)
                    # or a seal: the round's status comes with the wake-up.
                    since, raw = self._watch_get(keys.ctl(r), since, step.wake_at - now,
                                                 keys.status(r))
                    if decode_status(keys.status(r), raw) is True:
                        try:
                            self._keys_held.leave()
                        except RendezvousError as exc:  # the store may already be gone
                            logger.info("a spare leaving a closed run: %s", exc)
                        raise RendezvousClosedError(
                            f"the rendezvous of run {keys.run_id!r} is closed")
                    woken = raw is not None
                    continue
                # Most wake-ups are the seal: the rank comes with the wake-up (one round trip).
                since, raw = self._watch_get(keys.ctl(r), since, step.wake_at - now, rank_key)
                if raw is not None:
                    done, info = self._collect(r, raw, None, previous, status_read=False)
                    if done:
                        return info

    def _collect(
        self, r: int, raw: bytes | None, raw_status: bytes | None, previous: Membership | None,
        *, status_read: bool = True,
    ) -> tuple[bool, RendezvousInfo | None]:
        """This node's outcome of round r from its rank record and the round's status
        (:func:`read_outcome`): (True, its RendezvousInfo), (True, None) if it is late for the
        round, or (False, None) while the decision is not written yet (the caller waits on).
        A record of another decision than the round's (:func:`check_rank`: only a stale
        sealer on a store that cannot fence its writes leaves one) makes it late, never a
        member of a mixed world."""
        store, keys = self._store, self._keys
        rank_key = keys.rank(r, self._node_id)
        rank, decision, status = read_outcome(store, keys, r, rank_key, raw, raw_status,
                                              status_read)
        verdict = check_rank(decision, status)
        if verdict is Verdict.UNSEALED:
            return False, None
        if verdict is Verdict.CLOSED:
            self._keys_held.leave()
            raise RendezvousClosedError(f"the rendezvous of run {keys.run_id!r} is closed")
        if verdict is Verdict.LATE:
            if decision is not None:
                logger.warning("rendezvous %s: %s holds a rank of another decision than round "
                               "%d's (a stale sealer's write): not a member of it", keys.run_id,
                               self._node_id, r)
            logger.info("rendezvous %s: %s is late for round %d", keys.run_id, self._node_id, r)
            self._keys_held.late(rank_key if raw else None)
            return True, None
        assert decision is not None
        self._keys_held.member(rank_key)
        self._member = Membership(r, rank, decision.world_size, previous is not None)
        return True, RendezvousInfo(
            PrefixStore(keys.user(r), store),
            rank,
            decision.world_size,
            RendezvousStoreInfo(decision.master_addr, decision.master_port),
        )

    # -- helpers ----------------------------------------------------------------------------------
    def _query(self) -> Store:
        """The store for queries: the second client while a round is being joined, if any."""
        return self._side.get(joining=self._lock.locked())

    def _reserve_port(self) -> int:
        """A port for this round's bootstrap store (held; the previous round's is released)."""
        if self._port is not None:
            self._port.release()
        self._port = PortReservation(self._host)
        return self._port.port

    def _forget_session(self, exc: SessionExpiredError) -> None:
        """The store session (its ephemeral keys) expired: the others have dropped this node,
        which joins again as a new node, under a new node id (a seal that listed its old
        descriptor just before it vanished must not hand the new node that one's rank)."""
        old, self._node_id = self._node_id, new_node_id(self._host)
        self._sealer.node_id = self._node_id
        logger.warning("rendezvous %s: %s lost its session (%s); joining again as new node %s",
                       self._keys.run_id, old, exc, self._node_id)
        self._member = None
        self._keys_held.forget()

    def _watch(self, path: str, since: int, seconds: float) -> int:
        """Wait for ``path`` to change after ``since``, at most ``seconds`` and one store
        timeout; the revision to wait after next time."""
        return max(since, self._store.watch(path, since, store_wait(self._store, seconds)))

    def _watch_get(
        self, path: str, since: int, seconds: float, key: str
    ) -> tuple[int, bytes | None]:
        """:meth:`_watch`, and the value of ``key`` once woken (None if missing)."""
        rev, value = self._store.watch_get(path, since, key, store_wait(self._store, seconds))
        return max(since, rev), value
