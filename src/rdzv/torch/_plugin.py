"""The ``torchrun.handlers`` entry point, importable while torch is still loading its plugins.

torch loads this entry point while ``torch.distributed.elastic.rendezvous`` is being imported,
and ``rdzv.torch`` itself imports that package: so this module imports nothing from torch, and
the creator it hands out imports the bridge only when torch creates a handler.
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
