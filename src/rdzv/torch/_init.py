"""One call to start torch.distributed in a worker launched by ``rdzv run``, torchrun, or by hand."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._channel import ENV_JOIN, ENV_JOIN_STORE
from ..errors import RendezvousParameterError
from ..store import Store
from ._group import group_options, group_sockets, join_running_group, start_provisional
from ._nodegroup import local_world
from ._store import TorchStore

logger = logging.getLogger(__name__)

ENV_NAMES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``rdzv run`` and torchrun give every worker (and what ``env://`` reads)."""

DEFAULT_TIMEOUT = timedelta(minutes=10)

_in_use: list[TorchStore] = []
"""Adapters handed to torch: torch keeps only their C++ half, so their Python half lives here."""


def _env_int(name: str, given: int | None) -> int:
    if given is not None:
        return int(given)
    raw = os.environ.get(name)
    if raw is None:
        raise RendezvousParameterError(
            f"{name} is not set: pass {name.lower()}= or start the worker with `rdzv run` or torchrun."
        )
    try:
        return int(raw)
    except ValueError:
        raise RendezvousParameterError(f"env {name}={raw!r} is not an integer") from None


def init_process_group(
    backend: str = "gloo",
    *,
    store: Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: timedelta | float | None = None,
    **kwargs: Any,
) -> tuple[int, int]:
    """Start the default process group of this worker; returns ``(rank, world_size)``.

    Without ``store``, the worker was started by ``rdzv run`` or torchrun: rank, world size and
    the bootstrap address come from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (global rank 0
    hosts torch's TCPStore there, as ``env://`` does). With ``store`` (any rdzv store, e.g. a
    round's ``RendezvousInfo.store``) the group bootstraps through it: ``rank`` and
    ``world_size`` are then given or read from RANK and WORLD_SIZE. Other keyword arguments go
    to ``torch.distributed.init_process_group``.

    A worker that ``rdzv run`` started to join a running group in-process (a newcomer: its
    environment has ``RDZV_INPROCESS_JOIN``) joins it in :class:`ElasticState`, warm: when
    every worker of its node joins, this starts a provisional group of the node's workers and
    returns ``(local rank, local world size)``, so that what comes before ``ElasticState``
    (sharding the model over :func:`node_mesh`, making the optimizer) costs the running workers
    nothing; a worker that joins alone (its node's others run) waits here for the switch.

    Raises:
        RendezvousParameterError: rank or world size is unknown or invalid (the message says
            which variable or argument to give).
    """
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    timeout = timeout or DEFAULT_TIMEOUT
    group_options.update(timeout=timeout, kwargs=dict(kwargs))
    if store is None and os.environ.get(ENV_JOIN):
        if os.environ.get(ENV_JOIN_STORE):
            local_rank, size = local_world()
            start_provisional(backend, local_rank, size)
            logger.info("started the node's provisional group %s (rank %d of %d) to join the "
                        "running group warm", backend, local_rank, size)
            return local_rank, size
        rank, world_size = join_running_group(backend)
        logger.info("joined the running group %s: rank %d of %d", backend, rank, world_size)
        return rank, world_size
    rank = _env_int("RANK", rank)
    world_size = _env_int("WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise RendezvousParameterError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
    if store is None:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise RendezvousParameterError(
                f"{' and '.join(missing)} not set: start the worker with `rdzv run` or torchrun, "
                "or pass store= (an rdzv store every worker shares)."
            )
        with group_sockets.recording():  # to abort the group if a peer is lost
            dist.init_process_group(backend, init_method="env://", rank=rank,
                                    world_size=world_size, timeout=timeout, **kwargs)
    else:
        adapter = store if isinstance(store, TorchStore) else TorchStore(store)
        _in_use.append(adapter)
        dist.init_process_group(backend, store=adapter, rank=rank, world_size=world_size,
                                timeout=timeout, **kwargs)
    logger.info("process group %s started: rank %d of %d", backend, rank, world_size)
    return rank, world_size


def destroy_process_group() -> None:
    """End this worker's default process group: a barrier (no rank closes its connections
    while a peer still reads from them), then ``torch.distributed.destroy_process_group()``.

    With torch 2.13's gloo, a group that something else still holds (DDP does) is destroyed
    later, often at interpreter exit, and its destructor can deadlock there: it joins its worker
    thread while holding the GIL, and that thread needs the GIL to release the Python tensors of
    the last collective it ran (about one exit in eight on 2 loaded cores). A worker that must
    not hang leaves with ``os._exit`` after its last output, as ``examples/elastic_train.py``
    does.
    """
    dist.barrier()
    dist.destroy_process_group()
