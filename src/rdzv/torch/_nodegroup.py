"""The process group of one node's workers, made once and kept for the life of the workers:
the shard group of sharded training (FSDP2 over :func:`node_mesh`).

FSDP2 and the device mesh hold a ``ProcessGroup`` object from the moment a module is sharded.
Under ``rdzv run`` every membership change replaces the job's process group (a new default group
under a fresh store prefix), which destroys every group registered with torch. This one is not
registered there, so it lives on: it is made among the node's workers through the job's store of
the moment (``node_mesh()``, a collective), its connections join only the node's own workers,
and they do not change while those workers live (a worker that crashes takes its node's workers
with it: they restart together and make a new one). Aborts and switches leave its sockets alone:
a lost node is never a member of it. In every group a worker enters (``enter_group``) the group's
name is registered again with torch (functional collectives and DCP find a group by its name)
and the layout of the new group is checked (:meth:`NodeGroup.entered`).

A node's workers are the ranks ``rank // local_world_size`` of the job: ``rdzv run`` and torchrun
number a node's workers consecutively, and sharded training needs the same number of workers on
every node (``--nproc-per-node``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import RendezvousParameterError
from ._group import SwitchError, entering_hooks, group_options

_c10d = torch._C._distributed_c10d  # type: ignore[attr-defined]

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName


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

    NAME = cast("GroupName", "rdzv-node")

    def __init__(self, backend: str, device_type: str, timeout: timedelta) -> None:
        self.local_rank, self.size = local_world()
        self.device_type = device_type
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if device_type == "cuda" else torch.device("cpu")
        """Where this worker's tensors for the group's collectives live."""
        self._check_layout()
        node = dist.get_rank() // self.size
        store = dist.PrefixStore(f"rdzv-node/{node}/", dist.distributed_c10d._get_default_store())
        self.pg = _c10d.ProcessGroup(store, self.local_rank, self.size)
        made: Any
        if backend == "nccl":  # (torch's stub asks for options; its constructor has defaults)
            made = _c10d.ProcessGroupNCCL(  # type: ignore[call-arg]
                store, self.local_rank, self.size)
            kind = _c10d.ProcessGroup.BackendType.NCCL
        else:
            made = _c10d.ProcessGroupGloo(store, self.local_rank, self.size, timeout)
            kind = _c10d.ProcessGroup.BackendType.GLOO
        self.pg._set_default_backend(kind)
        self.pg._register_backend(torch.device(device_type), kind, made)
        self.pg._set_group_name(self.NAME)
        _c10d._register_process_group(self.NAME, self.pg)
        first = dist.get_rank() - self.local_rank
        self.mesh = DeviceMesh(device_type, torch.arange(first, first + self.size,
                                                         dtype=torch.int),
                               mesh_dim_names=("shard",), _init_backend=False)
        # what DeviceMesh.from_group does for a group torch has registered
        self.mesh._dim_group_names = [self.NAME]
        self.mesh._pg_registry[self.NAME] = self.pg

    def entered(self) -> None:
        """In a group just entered (a collective of the job's workers): check its layout, and
        register the group's name again (the new job group emptied torch's registry)."""
        self._check_layout()
        _c10d._register_process_group(self.NAME, self.pg)

    def _check_layout(self) -> None:
        """SwitchError unless every node of the job's group runs as many workers as this one,
        numbered node by node (an all_gather of two numbers per worker)."""
        mine = torch.tensor([dist.get_rank() % self.size == self.local_rank, self.size],
                            dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        if any(not bool(t[0]) or int(t[1]) != self.size for t in everyone):
            raise SwitchError(
                "sharded training over node_mesh() needs the same number of workers on every "
                f"node (--nproc-per-node), all of them in the group: this node runs {self.size}, "
                f"the nodes run {sorted({int(t[1]) for t in everyone})}")


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
        return node_group[0].mesh
    backend = str(dist.get_backend())
    device = device_type or ("cuda" if backend == "nccl" else "cpu")
    group = NodeGroup(backend, device, group_options["timeout"])
    node_group.append(group)
    entering_hooks.append(group.entered)
    return group.mesh
