"""The public rendezvous interfaces: the handler ABC, what a round hands out, and its parameters.

Names and behaviour follow ``torch.distributed.elastic.rendezvous`` so that code and tools written
against torch switch by changing an import. rdzv adds :meth:`RendezvousHandler.next_rendezvous_async`
and :meth:`RendezvousHandler.wait_for_membership_change` (declared here, implemented by backends).
"""

from __future__ import annotations

import abc
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

from ..errors import RendezvousParameterError
from ..store import DEFAULT_SESSION_TTL, Store
from ._params import check_config, convert_value, option_value
from ._views import MembershipView, RoundChanges

_DEFAULT_POLL_INTERVAL = 1.0
"""Seconds between checks in the default :meth:`RendezvousHandler.wait_for_membership_change`."""


@dataclass(frozen=True)
class RendezvousStoreInfo:
    """Where the workers' bootstrap store lives (torch 2.4+): the address and port of a TCPStore.

    Rank 0 of a round chooses it (its address and a free port, or the port of a store it
    already serves); every member of the round receives the same value.
    """

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"

    master_addr: str
    master_port: int


class RendezvousInfo:
    """What :meth:`RendezvousHandler.next_rendezvous` returns: this node's place in the new round.

    For code written against older torch, it also unpacks as ``store, rank, world_size``.
    """

    __slots__ = ("_store", "_rank", "_world_size", "_bootstrap_store_info")

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        bootstrap_store_info: RendezvousStoreInfo | None = None,
    ) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._bootstrap_store_info = bootstrap_store_info

    @property
    def store(self) -> Store:
        """A store shared by the members of this round only (scoped to the run and the round)."""
        return self._store

    @property
    def rank(self) -> int:
        """This node's rank in the round, in ``0 .. world_size - 1``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many nodes the round has."""
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        """Where the workers' bootstrap store lives, or None if the backend does not say."""
        return self._bootstrap_store_info

    def _as_tuple(self) -> tuple[Store, int, int]:
        return (self._store, self._rank, self._world_size)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._as_tuple())

    def __getitem__(self, index: int) -> Any:
        return self._as_tuple()[index]

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        return (
            f"RendezvousInfo(rank={self._rank}, world_size={self._world_size}, "
            f"bootstrap_store_info={self._bootstrap_store_info!r})"
        )


class RendezvousHandler(abc.ABC):
    """The rendezvous of one run: forms rounds of nodes and tells each node its rank.

    An elastic agent calls :meth:`next_rendezvous` to join a round, watches for membership
    changes while its workers run, and joins the next round when a node is lost or is waiting.
    """

    @abc.abstractmethod
    def get_backend(self) -> str:
        """The name of this handler's backend (as registered, e.g. ``"tcp"``)."""

    @property
    def use_agent_store(self) -> bool:
        """Whether the workers may reuse the agent's store (``RendezvousInfo.store``) to bootstrap."""
        return False

    @abc.abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and block until it forms (or raise).

        Raises:
            RendezvousClosedError: the rendezvous was closed.
            RendezvousTimeoutError: the round did not form within the join timeout.
            RendezvousConnectionError: the backend could not be reached.
            RendezvousStateError: the rendezvous state is corrupt or foreign.
            RendezvousGracefulExitError: this node was asked to leave.
        """

    def next_rendezvous_async(self) -> "Future[RendezvousInfo]":
        """Start joining the next round in the background and return at once.

        The caller keeps working (e.g. its workers keep training) and later checks
        ``future.done()``, waits with ``future.result(timeout)`` or cancels; the future holds
        the :class:`RendezvousInfo` or the error :meth:`next_rendezvous` would have raised.
        Backends that form rounds without blocking should override this; the default runs
        :meth:`next_rendezvous` on a daemon thread.
        """
        return run_in_background(self.next_rendezvous, f"rdzv-next-{self.get_run_id()}")

    @abc.abstractmethod
    def is_closed(self) -> bool:
        """Whether the rendezvous is closed (the job is over: no new round will form)."""

    @abc.abstractmethod
    def set_closed(self) -> None:
        """Close the rendezvous for every node of the run."""

    @abc.abstractmethod
    def num_nodes_waiting(self) -> int:
        """How many nodes wait to join a round after the current one (0 if none)."""

    def wait_for_membership_change(self, timeout: float) -> bool:
        """Block until the current round's membership changes, at most ``timeout`` seconds.

        Returns True as soon as a member of this node's current round is lost (died, hung past
        its heartbeat, or left) or a node is waiting to join; False on timeout. An agent calls
        it in a loop instead of polling :meth:`num_nodes_waiting` itself. Backends that are
        woken by the change itself override this; the default checks
        :meth:`num_nodes_waiting` about once a second until the timeout.
        """
        if timeout < 0:
            raise RendezvousParameterError(f"timeout must be >= 0 seconds, got {timeout}")
        deadline = time.monotonic() + timeout
        while self.num_nodes_waiting() <= 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(_DEFAULT_POLL_INTERVAL, remaining))
        return True

    def is_spare(self) -> bool:
        """Whether this node, waiting in :meth:`next_rendezvous`, is a spare: the job runs at
        its maximum size, and this node waits (without a deadline) to take the place of a
        member that leaves or is lost. False where the backend has no spares."""
        return False

    def round_changes(self) -> RoundChanges:
        """The nodes waiting to join and the members of this node's round that are lost, for
        an agent that re-forms only when told to (torch's). This default knows no losses."""
        return RoundChanges(waiting=self.num_nodes_waiting(), lost=0)

    def membership(self, since: int = 0,
                   timeout: float = 0.0) -> tuple[MembershipView, int] | None:
        """This member's round as seen now (counts of members alive, nodes waiting, members
        moved on) and a revision to wait after, or None if the backend cannot tell (the
        caller then uses :meth:`wait_for_membership_change`). See the dynamic backends."""
        return None

    def announce_leaving(self) -> bool:
        """Tell the other members that this node leaves after its current round (graceful
        scale-in, e.g. on a preemption notice): they form the next round without waiting for
        it, while this node goes on working until they have moved on.

        Returns whether the backend could announce it; False (the default) means the node
        simply leaves when it shuts down, and the others notice it as lost.
        """
        return False

    @abc.abstractmethod
    def get_run_id(self) -> str:
        """The run id shared by the nodes of this job."""

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Leave the rendezvous gracefully and release resources; whether it went cleanly."""


def run_in_background(call: Callable[[], RendezvousInfo], name: str) -> "Future[RendezvousInfo]":
    """Run ``call`` on a daemon thread; its result or error lands in the returned future."""
    future: Future[RendezvousInfo] = Future()

    def runner() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as exc:  # the future carries every outcome to the caller
            future.set_exception(exc)

    threading.Thread(target=runner, name=name, daemon=True).start()
    return future


class RendezvousParameters:
    """Everything a backend needs to create a handler (torch's ``RendezvousParameters``).

    Args:
        backend: the backend name, e.g. ``"tcp"``, ``"file"``, ``"static"``, ``"memory"``.
        endpoint: where the backend's store is: ``host:port``, a directory, or ``""``.
        run_id: the id shared by the nodes of one job.
        min_nodes: the smallest round that may form (>= 1).
        max_nodes: the largest round (>= min_nodes).
        local_addr: this node's address, as the other nodes reach it (None: guessed).
        **kwargs: backend options (see ``docs/rendezvous.md``). For built-in backends each
            option is checked against the backend's table: unknown names and values of the
            wrong type raise ValueError; torch's older names are renamed to rdzv's.

    Raises:
        ValueError: a parameter is invalid; the message says which and what is expected.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(backend, str) or not backend.strip():
            raise RendezvousParameterError(
                "The rendezvous backend name must be a non-empty string, e.g. 'tcp' or 'static'."
            )
        if not isinstance(run_id, str) or not run_id.strip():
            raise RendezvousParameterError(
                "The rendezvous run_id must be a non-empty string shared by every node of the job,"
                " e.g. 'job-42'."
            )
        if "/" in run_id or any(ch.isspace() for ch in run_id):
            raise RendezvousParameterError(
                f"The rendezvous run_id {run_id!r} must not contain '/' or whitespace;"
                " use e.g. 'job-42'."
            )
        if local_addr is not None and (
            not isinstance(local_addr, str) or not local_addr
            or "/" in local_addr or any(ch.isspace() for ch in local_addr)
        ):
            raise RendezvousParameterError(
                f"The rendezvous local_addr {local_addr!r} must be this node's host name or IP "
                "address as the other nodes reach it (no '/' or whitespace), e.g. '10.0.0.5'."
            )
        if endpoint is None:
            endpoint = ""
        if not isinstance(endpoint, str):
            raise RendezvousParameterError(
                f"The rendezvous endpoint must be a string such as 'host:29400', "
                f"not {type(endpoint).__name__}."
            )
        min_nodes = _node_count("min_nodes", min_nodes)
        max_nodes = _node_count("max_nodes", max_nodes)
        if min_nodes < 1:
            raise RendezvousParameterError(
                f"The minimum number of rendezvous nodes (min_nodes={min_nodes}) must be"
                " greater than zero."
            )
        if max_nodes < min_nodes:
            raise RendezvousParameterError(
                f"The maximum number of rendezvous nodes (max_nodes={max_nodes}) must be greater"
                f" than or equal to the minimum number of rendezvous nodes (min_nodes={min_nodes})."
            )
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.local_addr = local_addr
        self.config: dict[str, Any] = check_config(backend, kwargs)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of option ``key`` as given, or ``default`` if it was not given."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """The value of option ``key`` as a bool (``1/true/yes/on``, ``0/false/no/off``)."""
        value = self.get(key, default)
        if value is None:
            return value
        converted = convert_value(bool, value)
        if converted is None:
            raise RendezvousParameterError(
                f"The rendezvous configuration option '{key}' does not represent a valid boolean"
                f" value: got {value!r}; use one of 1/true/yes/on or 0/false/no/off."
            )
        return converted

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """The value of option ``key`` as an int."""
        value = self.get(key, default)
        if value is None:
            return value
        try:
            return int(value)
        except (TypeError, ValueError) as exc:
            raise RendezvousParameterError(
                f"The rendezvous configuration option '{key}' does not represent a valid integer"
                f" value: got {value!r}."
            ) from exc

    def get_option(self, name: str) -> Any:
        """Option ``name`` of a built-in backend, converted to its declared type, or its default."""
        return option_value(self.backend, name, self.config)

    @property
    def session_ttl(self) -> float:
        """Seconds after a node's last heartbeat at which the store ends its session (its
        ephemeral keys go, the others see it lost): ``heartbeat_interval x heartbeat_misses``.
        The one rule: every backend's store and the agent use it. A backend without heartbeats
        (static) has the store's default."""
        try:
            return float(self.get_option("heartbeat_interval") * self.get_option("heartbeat_misses"))
        except KeyError:
            return DEFAULT_SESSION_TTL

    def _key(self) -> tuple[Any, ...]:
        return (
            self.backend,
            self.endpoint,
            self.run_id,
            self.min_nodes,
            self.max_nodes,
            self.local_addr,
            sorted((k, str(v)) for k, v in self.config.items()),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RendezvousParameters):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable config: not hashable

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in sorted(self.config.items()))
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, "
            f"local_addr={self.local_addr!r}{options})"
        )


def _node_count(name: str, value: Any) -> int:
    """``min_nodes``/``max_nodes`` as an int, or a ValueError naming the parameter."""
    try:
        count = convert_value(int, value)
    except (TypeError, ValueError):
        count = None
    if count is None:
        raise RendezvousParameterError(f"The rendezvous parameter {name} must be an integer, got {value!r}.")
    return count
