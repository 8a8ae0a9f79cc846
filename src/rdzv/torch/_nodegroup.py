"""The process group of one node's workers: the shard group of sharded training (FSDP2 over
:func:`node_mesh`), made anew in every group a worker enters and handed to what holds it.

Under ``rdzv run`` every membership change replaces the job's process group (a new default group
under a fresh store prefix), which destroys every group registered with torch. The node's group
is not registered there: it is made by hand among the node's workers through the job group's
store (:class:`NodeGroup`), anew in every group the worker enters (``enter_group`` calls
:meth:`NodeGroup.entered`, among the sockets an abort shuts down: a worker that waits in it for
a local peer gone to recover fails at once, as in any group of the job). The device mesh keeps
its place (its registry names the new group) and the holders of the old group are given the new
one (:attr:`NodeGroup.holders`: FSDP2's modules, see ``_sharded``); torch reuses a backend it
has registered for a type, so a group cannot be given a new backend in place.

A node's workers are the ranks ``rank // local_world_size`` of the job: ``rdzv run`` and torchrun
number a node's workers consecutively, and sharded training needs the same number of workers on
every node (``--nproc-per-node``): checked in every group.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import RendezvousParameterError
from ._group import SwitchError, entering_hooks, group_options, group_sockets

logger = logging.getLogger(__name__)

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

    NAME = "rdzv-node"

    def __init__(self, backend: str, device_type: str, timeout: timedelta) -> None:
        self.local_rank, self.size = local_world()
        self.backend, self.device_type, self.timeout = backend, device_type, timeout
        self.holders: list[Callable[[dist.ProcessGroup], None]] = []
        """Called with each new group (what holds the old one takes the new one)."""
        self._check_layout()
        self.pg = self._make()
        first = dist.get_rank() - self.local_rank
        self.mesh = DeviceMesh(device_type, torch.arange(first, first + self.size,
                                                         dtype=torch.int),
                               mesh_dim_names=("shard",), _init_backend=False)
        # what DeviceMesh.from_group does for a group torch has registered
        self.mesh._dim_group_names = [self.NAME]
        self.mesh._pg_registry[self.NAME] = self.pg

    def _make(self) -> dist.ProcessGroup:
        """The node's workers' group, through the current job group's store (a collective of
        the node's workers)."""
        node = dist.get_rank() // self.size
        store = dist.PrefixStore(f"rdzv-node/{node}/", dist.distributed_c10d._get_default_store())
        pg = _c10d.ProcessGroup(store, self.local_rank, self.size)
        if self.backend == "nccl":
            made = _c10d.ProcessGroupNCCL(store, self.local_rank, self.size)
            kind = _c10d.ProcessGroup.BackendType.NCCL
        else:
            made = _c10d.ProcessGroupGloo(store, self.local_rank, self.size, self.timeout)
            kind = _c10d.ProcessGroup.BackendType.GLOO
        pg._set_default_backend(kind)
        pg._register_backend(torch.device(self.device_type), kind, made)
        pg._set_group_name(self.NAME)
        # functional collectives (a DTensor's full_tensor(), DCP) find a group by its name
        _c10d._register_process_group(self.NAME, pg)
        return pg

    def entered(self) -> None:
        """In a group just entered (a collective of the job's workers): check its layout, make
        the node's group anew and hand it to its holders."""
        self._check_layout()
        old, self.pg = self.pg, self._make()
        self.mesh._pg_registry[self.NAME] = self.pg
        for hold in self.holders:
            hold(self.pg)
        try:
            old.shutdown()
        except RuntimeError as exc:  # (its sockets were shut down already)
            logger.debug("shutting the node's old group down: %s", exc)

    def _check_layout(self) -> None:
        """SwitchError unless every node of the job's group runs as many workers as this one,
        numbered node by node (an all_gather of two numbers per worker)."""
        device = torch.device("cuda", torch.cuda.current_device()) \
            if self.device_type == "cuda" else torch.device("cpu")
        mine = torch.tensor([dist.get_rank() % self.size == self.local_rank, self.size],
                            dtype=torch.int64, device=device)
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
    with group_sockets.recording():  # an abort shuts its sockets down, as any group's
        group = NodeGroup(backend, device, group_options["timeout"])
    node_group.append(group)
    entering_hooks.append(group.entered)
    return group.mesh
