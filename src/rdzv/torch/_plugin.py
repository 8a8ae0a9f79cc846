"""The ``torchrun.handlers`` entry point, importable while torch is still loading its plugins.

torch loads this entry point while ``torch.distributed.elastic.rendezvous`` is being imported,
and ``rdzv.torch`` itself imports that package: so this module imports nothing from torch, and
the creator it hands out imports the bridge only when torch creates a handler. Programs that
start torch's agent themselves register the same creator (:func:`register_torch_backends`).
"""

from __future__ import annotations

from typing import Any, Callable


def create_handler(params: Any) -> Any:
    """torch's handler of an ``rdzv-*`` backend (see :func:`rdzv.torch.create_torch_handler`)."""
    from ._handler import create_torch_handler

    return create_torch_handler(params)


def torchrun_handler_creator() -> Callable[[Any], Any]:
    """What each ``torchrun.handlers`` entry point returns: one creator for every rdzv backend."""
    return create_handler


def register_torch_backends() -> list[str]:
    """Register ``rdzv-tcp``, ``rdzv-file`` and ``rdzv-etcd`` in torch's handler registry.

    For programs that start torch's agent themselves (torchrun finds them through the entry
    points). Names already registered with the same creator are left as they are. Returns the
    names.
    """
    from torch.distributed.elastic.rendezvous import api as torch_api

    from ._handler import BACKEND_PREFIX, TORCHRUN_BACKENDS

    names = [BACKEND_PREFIX + name for name in TORCHRUN_BACKENDS]
    for name in names:  # the entry points' creator: registering again is then a no-op
        torch_api.rendezvous_handler_registry.register(name, create_handler)
    return names
