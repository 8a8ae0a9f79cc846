"""The process group of one node's workers, kept for the life of the process: the shard group of
sharded training (FSDP2 over :func:`node_mesh`).

FSDP2 and the device mesh hold a ``ProcessGroup`` object from the moment a module is sharded.
Under ``rdzv run`` every membership change replaces the job's process group (a new default group
under a fresh store prefix), which destroys every group registered with torch. This one is not
registered there: it is one ``ProcessGroup`` object for the whole process, whose backend (gloo,
or NCCL on GPUs) is made anew among the node's workers in every group the worker enters
(:meth:`NodeGroup.renew`, called by ``enter_group``), through that group's store. So what FSDP2 holds
stays valid across changes, and the node's connections are never older than the job's group.

A node's workers are the ranks ``rank // local_world_size`` of the job: ``rdzv run`` and torchrun
number a node's workers consecutively, and sharded training needs the same number of workers on
every node (``--nproc-per-node``); :class:`rdzv.torch.ElasticState` checks it at every change.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import RendezvousParameterError
from ._group import entering_hooks, group_options

_c10d = torch._C._distributed_c10d  # type: ignore[attr-defined]


def local_world() -> tuple[int, int]:
    """(this worker's local rank, the node's number of workers), from the launcher's variables."""
    try:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError) as exc:
        raise RendezvousParameterError(
            "node_mesh() needs LOCAL_RANK and LOCAL_WORLD_SIZE: start the workers with "
            "`rdzv run` or torchrun") from exc


class NodeGroup:
    """This node's workers as one process group (see the module's docstring)."""

    def __init__(self, backend: str, device_type: str, timeout: timedelta) -> None:
        self.local_rank, self.size = local_world()
        self.backend = backend
        self.device_type = device_type
        self.timeout = timeout
        self.name = f"rdzv-node-{os.getpid()}"
        self.pg: dist.ProcessGroup | None = None
        self.mesh: DeviceMesh | None = None
        self.renew()
        assert self.pg is not None
        self.mesh = DeviceMesh(device_type, torch.tensor(self._ranks(), dtype=torch.int),
                               mesh_dim_names=("shard",), _init_backend=False)
        # what DeviceMesh.from_group does for a group torch has registered
        self.mesh._dim_group_names = [self.name]
        self.mesh._pg_registry[self.name] = self.pg

    def _ranks(self) -> list[int]:
        first = dist.get_rank() - self.local_rank
        return list(range(first, first + self.size))

    def renew(self) -> None:
        """Make the group's backend anew among the node's workers, through the current job
        group's store (a collective of the node's workers, made as each enters a group)."""
        node = dist.get_rank() // self.size
        store = dist.PrefixStore(f"rdzv-node/{node}/",
                                 dist.distributed_c10d._get_default_store())
        if self.pg is None:
            self.pg = _c10d.ProcessGroup(store, self.local_rank, self.size)
            self.pg._set_group_name(self.name)
        pg = self.pg
        old = pg._get_backend(torch.device(self.device_type)) if self._has_backend() else None
        if self.backend == "nccl":
            backend = _c10d.ProcessGroupNCCL(store, self.local_rank, self.size)
            kind = _c10d.ProcessGroup.BackendType.NCCL
        else:
            backend = _c10d.ProcessGroupGloo(store, self.local_rank, self.size, self.timeout)
            kind = _c10d.ProcessGroup.BackendType.GLOO
        pg._set_default_backend(kind)
        pg._register_backend(torch.device(self.device_type), kind, backend)
        # the new job group emptied torch's registry of names: functional collectives (a
        # DTensor's full_tensor(), DCP) find the group by its name there
        _c10d._register_process_group(self.name, pg)
        if old is not None:
            old.shutdown()

    def _has_backend(self) -> bool:
        assert self.pg is not None
        try:
            self.pg._get_backend(torch.device(self.device_type))
        except RuntimeError:
            return False
        return True


node_group: list[NodeGroup] = []
"""This process's node group once :func:`node_mesh` made it (at most one)."""


def node_mesh(device_type: str | None = None) -> DeviceMesh:
    """The 1-D device mesh of this node's workers, for ``fully_shard(module, mesh=...)``: each
    node shards the model among its own workers and holds a replica of it, and under
    ``rdzv run`` the replicas follow membership in-process (:class:`ElasticState` moves a
    newcomer's shards from a live node and reduces the gradients over the replicas). A
    collective of the node's workers; later calls return the same mesh."""
    if not dist.is_initialized():
        raise RendezvousParameterError(
            "node_mesh() needs torch.distributed started first: call "
            "rdzv.torch.init_process_group() in a worker started by `rdzv run` or torchrun")
    if node_group:
        return node_group[0].mesh  # type: ignore[return-value]
    backend = str(dist.get_backend())
    device = device_type or ("cuda" if backend == "nccl" else "cpu")
    group = NodeGroup(backend, device, group_options["timeout"])
    node_group.append(group)
    entering_hooks.append(group.renew)
    return group.mesh  # type: ignore[return-value]
