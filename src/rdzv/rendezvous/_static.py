"""The static backend: a fixed rank and world size, and a store hosted by rank 0 (torch: static).

Every node knows its rank (option ``rank`` or env RANK) and the world size (option
``world_size``, env WORLD_SIZE, or max_nodes). Rank 0 hosts a TCPStore server at the endpoint
(the master address and port); the others connect to it. ``next_rendezvous`` returns once every
rank has arrived: each writes ``rdzv.static/<run_id>/arrived/<rank>`` and waits for all of them.
As in torch, the group never re-forms: later calls return the same round at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta

from .._address import parse_endpoint
from ..errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameterError,
    RendezvousTimeoutError,
    StoreAuthenticationError,
    StoreConnectionError,
    StoreProtocolError,
    StoreTimeoutError,
)
from ..store import PrefixStore, Store
from ._api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

logger = logging.getLogger(__name__)

_KEY_ROOT = "rdzv.static"
_CONNECT_RETRY_MAX_SLEEP = 0.5


def parse_host_port(endpoint: str, backend: str = "static") -> tuple[str, int]:
    """``host:port`` or ``[ipv6]:port`` as (host, port); ValueError with an example if not."""
    try:
        host, port = parse_endpoint(endpoint, None)
    except RendezvousParameterError as exc:
        problem = f" ({exc})"
    else:
        if port:
            return host, port
        problem = " (port 0 would leave the other nodes without the master's port)"
    raise RendezvousParameterError(
        f"The endpoint of the '{backend}' rendezvous backend must be the master's "
        f"HOST:PORT, e.g. '10.0.0.1:29400', got {endpoint!r}{problem}."
    )


class StaticRendezvousHandler(RendezvousHandler):
    """A fixed group of ``world_size`` nodes; rank 0 hosts the store at ``master_addr:master_port``.

    Args:
        store: an existing store shared by all nodes, to use instead of hosting or
            connecting to a TCPStore (then master_addr/master_port only tell the workers
            where the bootstrap store is).
    """

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        run_id: str,
        timeout: float = 600.0,
        store: Store | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise RendezvousParameterError(
                f"The static rendezvous rank must be in 0..{world_size - 1} "
                f"(world_size={world_size}), got rank={rank}."
            )
        self.master_addr = master_addr
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.timeout = timeout
        self._store = store
        self._owns_store = store is None
        self._info: RendezvousInfo | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()

    def get_backend(self) -> str:
        return "static"

    @property
    def use_agent_store(self) -> bool:
        """The workers reuse the store rank 0 hosts (as torch's static backend)."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """Wait until all ``world_size`` ranks have arrived (once); later calls return at once."""
        with self._lock:
            if self.is_closed():
                raise RendezvousClosedError(f"the static rendezvous '{self.run_id}' is closed")
            if self._info is None:
                deadline = time.monotonic() + self.timeout
                store = self._connect(deadline)
                self._barrier(store, deadline)
                self._info = RendezvousInfo(
                    PrefixStore(self.run_id, store),
                    self.rank,
                    self.world_size,
                    RendezvousStoreInfo(self.master_addr, self.master_port),
                )
            return self._info

    def _connect(self, deadline: float) -> Store:
        """The shared store: rank 0 hosts it, the others connect (retrying until it is up)."""
        if self._store is not None:
            return self._store
        from ..store import TCPStore  # imported on use: `import rdzv` must not load it

        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            try:
                store = TCPStore(
                    self.master_addr,
                    self.master_port,
                    is_master=self.rank == 0,
                    timeout=timedelta(seconds=max(remaining, 0.001)),
                )
                store.set_timeout(self.timeout)
                self._store = store
                return store
            except (StoreAuthenticationError, StoreProtocolError):
                raise
            except (StoreConnectionError, OSError) as exc:
                if self.rank == 0 or remaining <= delay:
                    raise RendezvousConnectionError(
                        f"static rendezvous '{self.run_id}': rank {self.rank} could not "
                        f"{'host' if self.rank == 0 else 'reach'} the store at "
                        f"{self.master_addr}:{self.master_port} ({exc}). Check that the endpoint "
                        f"is rank 0's address and a free port, and that rank 0 is running."
                    ) from exc
                logger.debug("store at %s:%s not up yet: %s", self.master_addr, self.master_port, exc)
                time.sleep(delay)
                delay = min(delay * 2, _CONNECT_RETRY_MAX_SLEEP)

    def _barrier(self, store: Store, deadline: float) -> None:
        """Announce this rank and wait for every rank; a timeout names the missing ranks, a lost
        store is a RendezvousConnectionError."""
        keys = [self._arrived_key(rank) for rank in range(self.world_size)]
        try:
            self._announce(store)
            store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.0)))
        except StoreTimeoutError as exc:
            # The error names the keys still missing: no further call to a store that may be gone.
            missing = [rank for rank, key in enumerate(keys) if key in exc.keys]
            raise RendezvousTimeoutError(
                f"static rendezvous '{self.run_id}': rank(s) {missing} of world_size "
                f"{self.world_size} did not arrive within {self.timeout:g} s at "
                f"{self.master_addr}:{self.master_port}. Start every rank with the same endpoint "
                f"and run id, or raise the 'timeout' option."
            ) from exc
        except StoreConnectionError as exc:
            raise RendezvousConnectionError(
                f"static rendezvous '{self.run_id}': rank {self.rank} lost the store hosted by "
                f"rank 0 at {self.master_addr}:{self.master_port} while waiting for the other ranks "
                f"({exc}); rank 0 stopped (timed out, failed or was killed)."
            ) from exc
        logger.info(
            "static rendezvous '%s' complete: rank %d of %d", self.run_id, self.rank, self.world_size
        )

    def _announce(self, store: Store) -> None:
        """Write this rank's arrival (a node restarted with the same rank replaces its token)."""
        key = self._arrived_key(self.rank)
        token = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        previous = store.compare_set(key, "", token)
        if previous.decode(errors="replace") not in ("", token):
            logger.warning(
                "static rendezvous '%s': rank %d was already announced by %s; replacing it "
                "(a restarted node, or two nodes given the same rank)",
                self.run_id, self.rank, previous.decode(errors="replace"),
            )
            store.set(key, token)

    def _arrived_key(self, rank: int) -> str:
        return f"{_KEY_ROOT}/{self.run_id}/arrived/{rank}"

    def is_closed(self) -> bool:
        if self._closed.is_set():
            return True
        store = self._store
        if store is not None and store.try_get(f"{_KEY_ROOT}/{self.run_id}/closed") is not None:
            self._closed.set()
        return self._closed.is_set()

    def set_closed(self) -> None:
        """Close the rendezvous here and, once connected, for every node."""
        self._closed.set()
        if self._store is not None:
            self._store.set(f"{_KEY_ROOT}/{self.run_id}/closed", "1")

    def num_nodes_waiting(self) -> int:
        """Always 0: a static group admits no new nodes."""
        return 0

    def wait_for_membership_change(self, timeout: float) -> bool:
        """A static group never changes: wait ``timeout`` (or until closed here) and return False."""
        if timeout < 0:
            raise RendezvousParameterError(f"timeout must be >= 0 seconds, got {timeout}")
        self._closed.wait(timeout)
        return False

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        """Close the store connection this handler opened (rank 0: stops serving it)."""
        self._closed.set()
        store, self._store = self._store, None
        if store is not None and self._owns_store:
            store.close()
        return True


def create_handler(params: RendezvousParameters) -> StaticRendezvousHandler:
    """The static handler for ``params`` (rank and world size from options or the environment)."""
    rank = params.get_option("rank")
    if rank is None:
        rank = _from_env("RANK")
    world_size = params.get_option("world_size")
    if world_size is None:
        world_size = _from_env("WORLD_SIZE", required=False) or params.max_nodes
    if params.min_nodes != params.max_nodes or world_size != params.max_nodes:
        raise RendezvousParameterError(
            f"A static rendezvous has a fixed size: min_nodes ({params.min_nodes}), max_nodes "
            f"({params.max_nodes}) and world_size ({world_size}) must be equal."
        )
    host, port = parse_host_port(params.endpoint)
    return StaticRendezvousHandler(
        host,
        port,
        rank,
        world_size,
        params.run_id,
        timeout=params.get_option("timeout"),
    )


def _from_env(name: str, required: bool = True) -> int | None:
    value = os.environ.get(name)
    if value is None:
        if required:
            raise RendezvousParameterError(
                f"The static rendezvous needs this node's {name.lower()}: give the option "
                f"{name.lower()}=N (e.g. static://HOST:PORT/RUN_ID?rank=0&world_size=2) or set "
                f"the environment variable {name}."
            )
        return None
    if not value.strip().isdigit():
        raise RendezvousParameterError(f"The environment variable {name} must be an integer >= 0, got {value!r}.")
    return int(value)
