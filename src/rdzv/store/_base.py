"""The Store interface: torch.distributed.Store's methods plus what the rendezvous needs.

Every implementation (HashStore, FileStore, TCPStore, PrefixStore, the etcd store) derives from
:class:`Store` and passes one contract suite (``tests/store/store_contract.py``).

Beyond torch's API a store may offer, as declared in :attr:`Store.capabilities`:

* **watch** -- :meth:`Store.watch` returns as soon as a key, or any key under a directory
  path, changes after a revision the caller already saw; blocking ``get``/``wait`` wake on the
  write itself rather than by polling.
* **ephemeral** -- ``set(..., ephemeral=True)`` ties a key to this client's session: it is deleted
  when the client closes the store, when its process dies (its connection or lock goes away), or
  when its heartbeat lapses for ``session_ttl`` seconds (a hung or cut-off client).
* **listing** -- :meth:`Store.list_keys` and :meth:`Store.count_keys` by prefix.
* **conditional** -- :meth:`Store.multi_set_if` writes several keys only while conditions on
  other keys hold, as one atomic step (a fenced write: a lock still names its holder).

Paths used by ``watch`` and ``revision`` are either an exact key (``"job/round"``), a directory
(``"job/nodes/"``, trailing slash: every key that starts with it) or ``""`` (the whole store).
Revisions are positive integers that only grow; a path never written has revision 0.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import ClassVar, Iterator, Mapping, Optional, Sequence, Union

from ..errors import StoreUnsupportedError, StoreValueError
from . import _queue

Value = Union[str, bytes, bytearray, memoryview]
Conditions = Mapping[str, Optional[Value]]
"""What :meth:`Store.multi_set_if` requires: key -> the exact value it must hold (None: the key
must be missing)."""
Timeout = Union[float, int, timedelta, None]

DEFAULT_TIMEOUT = timedelta(seconds=300)
"""torch's default store timeout, used when a store is created without one."""


@dataclass(frozen=True)
class StoreCapabilities:
    """What a store implementation offers beyond torch's Store API."""

    watch: bool
    """``watch`` and blocking reads are woken by the write itself (no polling)."""
    ephemeral: bool
    """Keys can be tied to the client's session (``set(..., ephemeral=True)``)."""
    listing: bool
    """``list_keys`` and ``count_keys`` work by prefix."""
    multi_process: bool
    """Several processes (or hosts) can share the store."""
    conditional: bool = False
    """:meth:`Store.multi_set_if`: a multi-key write applied atomically only while conditions hold."""
    atomic_writes: int | None = None
    """The most keys one :meth:`Store.multi_set_if` writes in one atomic step (None: any
    number). A longer write goes in several steps, each fenced by the conditions."""


@dataclass(frozen=True)
class Reads:
    """The answers of one :meth:`Store.read_many` call, keyed by what was asked."""

    values: dict[str, bytes | None]
    """``try_get`` of each key asked: its value, or None if it is missing."""
    counts: dict[str, int]
    """``count_keys`` of each prefix asked."""
    revisions: dict[str, int]
    """``revision`` of each path asked."""
    lists: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """``list_keys`` of each prefix asked."""


def to_bytes(value: Value) -> bytes:
    """Convert a store value (str is UTF-8 encoded) to bytes."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be str or bytes, not {type(value).__name__}")


def check_key(key: str) -> str:
    """Validate a key: a non-empty str."""
    if not isinstance(key, str):
        raise TypeError(f"store keys must be str, not {type(key).__name__}")
    if not key:
        raise ValueError("store keys must not be empty")
    return key


def to_seconds(timeout: Timeout, default: float) -> float:
    """A timeout given as seconds or timedelta (None: the default) as float seconds >= 0."""
    if timeout is None:
        return default
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds < 0:
        raise ValueError(f"timeout must be >= 0, got {seconds}")
    return seconds


def check_conditional_write(
    conditions: Conditions, keys: Sequence[str], values: Sequence[Value]
) -> tuple[dict[str, bytes | None], list[str], list[bytes]]:
    """The arguments of :meth:`Store.multi_set_if`, validated and as bytes."""
    if len(keys) != len(values):
        raise StoreValueError(f"multi_set_if got {len(keys)} keys but {len(values)} values")
    if not conditions:
        raise StoreValueError("multi_set_if needs at least one condition (else use multi_set)")
    checked = {check_key(k): None if v is None else to_bytes(v) for k, v in conditions.items()}
    return checked, [check_key(k) for k in keys], [to_bytes(v) for v in values]


class Store(abc.ABC):
    """A key-value store with the API of ``torch.distributed.Store``.

    Keys are ``str``; values ``str`` or ``bytes`` and always returned as ``bytes``. A store object
    may be shared by the threads of a process.
    """

    capabilities: ClassVar[StoreCapabilities]

    def __init__(self, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
        self._timeout = to_seconds(timeout, DEFAULT_TIMEOUT.total_seconds())

    # -- timeouts ---------------------------------------------------------------------------
    @property
    def timeout(self) -> timedelta:
        """How long blocking calls (get, multi_get, wait without a timeout) wait."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: Timeout) -> None:
        self._timeout = to_seconds(timeout, self._timeout)

    # -- torch's Store API --------------------------------------------------------------------
    @abc.abstractmethod
    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        """Write ``value`` under ``key``, waking every reader blocked on it."""

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to :attr:`timeout` for it to be set."""
        return self._get_blocking([check_key(key)], self._timeout)[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to :attr:`timeout` for all of them."""
        return self._get_blocking([check_key(k) for k in keys], self._timeout)

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        """Block until every key in ``keys`` exists; raise StoreTimeoutError after ``timeout``."""
        self._wait([check_key(k) for k in keys], to_seconds(timeout, self._timeout))

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (missing counts as 0); the new value."""

    @abc.abstractmethod
    def compare_set(
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        """Write ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is empty).

        Returns ``desired`` when written, else the current value (``expected`` if the key is
        missing), exactly as torch's stores do.
        """

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key in ``keys`` exists, without waiting."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """The number of keys in the store."""

    @abc.abstractmethod
    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Write several keys at once (atomically where the implementation can)."""

    def multi_set_if(
        self, conditions: Conditions, keys: Sequence[str], values: Sequence[Value]
    ) -> bool:
        """Write ``keys`` (plain, not ephemeral) only if every key of ``conditions`` holds exactly
        its value (None: the key is missing), as one atomic step; whether it wrote.

        A fenced write (capability ``conditional``): a lock holder writes its decision only
        while the lock still names it, so a holder that was paused past its lock's life writes
        nothing. Stores without the capability raise StoreUnsupportedError.
        """
        raise StoreUnsupportedError(
            f"{type(self).__name__} cannot write conditionally (capability 'conditional')"
        )

    @abc.abstractmethod
    def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the value of ``key`` (a missing key is created)."""

    # -- torch's queues (see :mod:`._queue`) ------------------------------------------------------
    def queue_push(self, key: str, value: Value) -> None:
        """Append ``value`` to the queue at ``key`` (its value holds the queue: do not ``set`` it)."""
        _queue.push(self, check_key(key), to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Take the first item of the queue at ``key``. ``block``: wait for one up to
        :attr:`timeout` (then StoreTimeoutError), else raise QueueEmptyError if it is empty."""
        return _queue.pop(self, check_key(key), bool(block))

    def queue_len(self, key: str) -> int:
        """How many items the queue at ``key`` holds (0 if it does not exist)."""
        return _queue.length(self, check_key(key))

    # -- rdzv's extensions ----------------------------------------------------------------------
    @abc.abstractmethod
    def try_get(self, key: str) -> bytes | None:
        """The value of ``key``, or None if it is missing; never waits."""

    @abc.abstractmethod
    def list_keys(self, prefix: str) -> dict[str, bytes]:
        """Every key starting with ``prefix`` and its value (capability ``listing``)."""

    @abc.abstractmethod
    def count_keys(self, prefix: str) -> int:
        """How many keys start with ``prefix`` (capability ``listing``)."""

    @abc.abstractmethod
    def revision(self, path: str = "") -> int:
        """The revision of the last change to ``path`` (a key, a ``dir/`` or ``""``); 0 if none."""

    @abc.abstractmethod
    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        """Wait until ``path`` changes after revision ``since``; return its new revision.

        Returns at once if it already changed. On timeout (default: :attr:`timeout`) returns a
        revision ``<= since`` instead of raising, so a caller can loop on its own deadline.
        """

    def watch_get(
        self, path: str, since: int, key: str, timeout: Timeout = None
    ) -> tuple[int, bytes | None]:
        """:meth:`watch`, then the value of ``key`` (None if missing): ``(revision, value)``.

        For a waiter that, once woken, reads one key first (a joiner its rank): TCPStore
        answers both in one round trip; this default makes the two calls.
        """
        revision = self.watch(path, since, timeout)
        return revision, self.try_get(key)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writes (``set``, ``multi_set``) made inside may travel with the next request instead
        of one by one; all of them have been sent when the block ends. Reads inside see them.

        TCPStore sends them in one message with the next request (fewer messages, and fewer
        wake-ups of the server); this default sends each write at once.
        """
        yield

    def read_many(
        self,
        keys: Sequence[str] = (),
        counts: Sequence[str] = (),
        revisions: Sequence[str] = (),
        lists: Sequence[str] = (),
    ) -> Reads:
        """Several non-blocking reads in one call: ``try_get`` of ``keys``, ``count_keys`` of
        ``counts``, ``revision`` of ``revisions`` and ``list_keys`` of ``lists``.

        Stores that can answer them in one round trip do so (TCPStore pipelines the requests,
        the etcd store sends one transaction); this default makes the calls one by one. The
        answers need not come from one instant, but the revisions are read first: a ``watch``
        from one of them misses no change that the other answers do not already show.
        """
        revision_of = {path: self.revision(path) for path in revisions}
        return Reads(
            {key: self.try_get(key) for key in keys},
            {prefix: self.count_keys(prefix) for prefix in counts},
            revision_of,
            {prefix: self.list_keys(prefix) for prefix in lists},
        )

    def close(self) -> None:
        """Release the store's resources; ephemeral keys of this client are deleted."""

    # -- what implementations provide ---------------------------------------------------------
    @abc.abstractmethod
    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        """The values of ``keys`` once all exist; StoreTimeoutError after ``timeout`` seconds."""

    def _wait(self, keys: list[str], timeout: float) -> None:
        self._get_blocking(keys, timeout)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
