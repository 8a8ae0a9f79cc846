"""torchrun plugin: rdzv's rendezvous backends as torch ``RendezvousHandler``s.

torch's launcher loads the entry-point group ``torchrun.handlers``: each entry point is a callable
taking no argument that returns a creator ``creator(torch_params) -> torch RendezvousHandler``.
rdzv registers its dynamic backends there as ``rdzv-tcp``, ``rdzv-file`` and ``rdzv-etcd`` (torch
already owns ``c10d``, ``etcd``, ``etcd-v2`` and ``static``), so that

    torchrun --rdzv-backend=rdzv-tcp --rdzv-endpoint=HOST:29400 --nnodes=2:4 train.py

runs torch's own agent on rdzv's rendezvous. :class:`TorchRendezvousHandler` is the bridge: it
converts torch's parameters, wraps the round's store in a :class:`TorchStore` and maps rdzv's
errors to torch's classes of the same names.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NoReturn, cast

from torch.distributed.elastic.rendezvous import api as torch_api

from .. import errors
from ..agent import wait_until_others_left
from ..rendezvous import (
    AGENT_ALIVE,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    get_rendezvous_handler,
)
from ._store import TorchStore

logger = logging.getLogger(__name__)

BACKEND_PREFIX = "rdzv-"
"""torch's name of an rdzv backend: ``rdzv-`` + rdzv's name (``rdzv-tcp`` is rdzv's ``tcp``)."""

TORCHRUN_BACKENDS = ("tcp", "file", "etcd")
"""The rdzv backends offered to torchrun (as ``rdzv-tcp``, ``rdzv-file``, ``rdzv-etcd``)."""

_TORCH_ERRORS: tuple[tuple[type[errors.RendezvousError], type[Exception]], ...] = (
    (errors.RendezvousGracefulExitError, torch_api.RendezvousGracefulExitError),
    (errors.RendezvousClosedError, torch_api.RendezvousClosedError),
    (errors.RendezvousTimeoutError, torch_api.RendezvousTimeoutError),
    (errors.RendezvousConnectionError, torch_api.RendezvousConnectionError),
    (errors.RendezvousStateError, torch_api.RendezvousStateError),
    (errors.RendezvousError, torch_api.RendezvousError),
)
"""rdzv's error classes and torch's, most specific first."""

LEAVE_TIMEOUT = 30.0
"""Seconds the node serving the store waits, when shutting down, for the others to leave."""


def _reraise_as_torch(exc: errors.RendezvousError) -> NoReturn:
    """Raise torch's error class of the same name as ``exc`` (chained to it).

    Parameter errors stay as they are: they are ValueErrors, which is what torch raises too.
    """
    if isinstance(exc, errors.RendezvousParameterError):
        raise exc
    for ours, theirs in _TORCH_ERRORS:
        if isinstance(exc, ours):
            raise theirs(str(exc)) from exc
    raise exc


def rdzv_parameters(params: torch_api.RendezvousParameters) -> RendezvousParameters:
    """rdzv's parameters for torch's ``params`` (backend ``rdzv-X`` becomes rdzv's ``X``).

    Raises:
        RendezvousParameterError: the backend is not an rdzv one or an option is invalid.
    """
    backend = params.backend
    if not backend.startswith(BACKEND_PREFIX):
        raise errors.RendezvousParameterError(
            f"The torchrun backend {backend!r} is not one of rdzv's; use one of "
            f"{', '.join(BACKEND_PREFIX + name for name in TORCHRUN_BACKENDS)}."
        )
    config: dict[str, Any] = {k: v for k, v in params.config.items() if v is not None}
    return RendezvousParameters(
        backend[len(BACKEND_PREFIX):],
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **config,
    )


class TorchRendezvousHandler(torch_api.RendezvousHandler):
    """torch's RendezvousHandler interface over an rdzv handler.

    ``next_rendezvous`` returns torch's ``RendezvousInfo`` whose store is a :class:`TorchStore`
    scoped to the round and whose ``bootstrap_store_info`` names rank 0's address and a port it
    found free (the workers' MASTER_ADDR/MASTER_PORT). ``use_agent_store`` is False: rdzv's store
    server does not speak torch's TCPStore protocol, so the workers bootstrap their own TCPStore
    at that address, as torch's ``c10d`` backend does by default.

    With the tcp backend one node serves the store from its own process. torch's agent shuts the
    handler down right after its exit barrier, so that node could exit while the others still
    leave through its store; like ``rdzv run``, its :meth:`shutdown` first waits (at most
    ``LEAVE_TIMEOUT``) until the other nodes' sessions have ended.
    """

    def __init__(self, handler: RendezvousHandler, backend: str) -> None:
        self._handler = handler
        self._backend = backend
        self._round: RendezvousInfo | None = None

    @property
    def rdzv_handler(self) -> RendezvousHandler:
        """The rdzv handler this bridge forwards to."""
        return self._handler

    def get_backend(self) -> str:
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> torch_api.RendezvousInfo:
        try:
            info = self._handler.next_rendezvous()
        except errors.RendezvousError as exc:
            _reraise_as_torch(exc)
        bootstrap = info.bootstrap_store_info
        if bootstrap is None:
            raise torch_api.RendezvousStateError(
                f"the rdzv backend {self._backend!r} gave no bootstrap store address for the workers"
            )
        self._call(lambda: info.store.set(f"{AGENT_ALIVE}{info.rank}", b"1", ephemeral=True))
        self._round = info
        return torch_api.RendezvousInfo(
            TorchStore(info.store),
            info.rank,
            info.world_size,
            torch_api.RendezvousStoreInfo(bootstrap.master_addr, bootstrap.master_port),
        )

    def is_closed(self) -> bool:
        return self._call(self._handler.is_closed)

    def set_closed(self) -> None:
        self._call(self._handler.set_closed)

    def num_nodes_waiting(self) -> int:
        """The nodes waiting to join, plus the members of this node's round that are lost.

        torch's agent re-forms its group only when this is positive (or when a worker fails);
        it does not watch for lost members. A member lost after the round formed but before its
        workers joined the workers' process group fails no one: the other workers wait for it
        in ``init_process_group`` until its timeout (10 minutes by default), so the loss must
        count here. This node's own loss counts too (its store session expired while it was
        paused: the others dropped it, and it joins again as a new node).
        """
        changes = self._call(self._handler.round_changes)
        return changes.waiting + changes.lost

    def get_run_id(self) -> str:
        return self._handler.get_run_id()

    def shutdown(self) -> bool:
        if self._round is not None:
            try:
                wait_until_others_left(self._round, self._handler, LEAVE_TIMEOUT)
            except errors.RendezvousError as exc:
                logger.warning("cannot wait for the other nodes to leave: %s", exc)
        return self._call(self._handler.shutdown)

    @staticmethod
    def _call(method: Callable[[], Any]) -> Any:
        try:
            return method()
        except errors.RendezvousError as exc:
            _reraise_as_torch(exc)


def create_torch_handler(params: torch_api.RendezvousParameters) -> TorchRendezvousHandler:
    """The torch handler of an ``rdzv-*`` backend for torch's ``params``."""
    # tcp, file and etcd (TORCHRUN_BACKENDS) are all the dynamic engine's backends
    handler = cast(RendezvousHandler, get_rendezvous_handler(rdzv_parameters(params)))
    logger.info("torchrun rendezvous on rdzv backend %s (run %s)", params.backend, params.run_id)
    return TorchRendezvousHandler(handler, params.backend)
