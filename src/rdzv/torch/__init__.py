"""rdzv with PyTorch: a ``torch.distributed.Store`` adapter, torchrun's backends, process-group setup.

Only this package imports torch (``pip install rdzv[torch]``); the rest of rdzv works without it.

* :class:`TorchStore` -- any rdzv store as a real ``torch.distributed.Store``.
* :func:`init_process_group` -- one call in a worker started by ``rdzv run`` or torchrun.
* :class:`ElasticState` -- a training loop that goes on through membership changes in-process.
* :func:`node_mesh` -- the device mesh of a node's workers: FSDP2 within nodes, replicas across
  them that follow membership in-process (HSDP).
* :class:`TorchRendezvousHandler` -- rdzv's backends for torch's agent; torchrun finds them
  through the ``torchrun.handlers`` entry points as ``rdzv-tcp``, ``rdzv-file``, ``rdzv-etcd``.

See ``docs/torch.md``.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ._elastic import ElasticState
from ._group import SwitchError
from ._init import destroy_process_group, init_process_group
from ._nodegroup import node_mesh
from ._plugin import (  # first: torch may load it while we import torch
    register_torch_backends,
    torchrun_handler_creator,
)
from ._store import TorchStore

if TYPE_CHECKING:
    from ._handler import TORCHRUN_BACKENDS, TorchRendezvousHandler, create_torch_handler

# Imported on first use: torch's agent needs them, a worker does not (they bring in the
# rendezvous engine and rdzv's agent, a third of a second of every worker's start).
_EXPORTS = {name: "._handler" for name in (
    "TORCHRUN_BACKENDS", "TorchRendezvousHandler", "create_torch_handler")}
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

__all__ = [
    "ElasticState",
    "SwitchError",
    "TORCHRUN_BACKENDS",
    "TorchRendezvousHandler",
    "TorchStore",
    "create_torch_handler",
    "destroy_process_group",
    "init_process_group",
    "node_mesh",
    "register_torch_backends",
    "torchrun_handler_creator",
]
