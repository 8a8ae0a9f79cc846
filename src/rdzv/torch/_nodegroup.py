"""The process group of one node's workers: the shard group of sharded training (FSDP2 over
:func:`node_mesh`), kept across membership changes, made anew only when one of its workers cut
it.

FSDP2 and the device mesh hold a ``ProcessGroup`` object from the moment a module is sharded.
Under ``rdzv run`` every membership change replaces the job's process group (a new default group
under a fresh store prefix), which destroys every group registered with torch. This one is not
registered there, so it lives on: it is made among the node's workers through the store of the
default group of the moment (``node_mesh()``, a collective: the job's group, or on a newcomer
node the provisional group its workers set up in before they join, see ``init_process_group``),
its connections join only the node's own workers
(a worker that crashes takes its node's workers with it: they restart together), and planned
switches leave it alone. In every group a worker enters (``enter_group``) the group's name is
registered again with torch (functional collectives and DCP find a group by its name) and the
layout of the new group is checked (:meth:`NodeGroup.entered`).

A node's workers do not leave a step at one point: one may take a recovery at its step's end
while a local peer already waits for it in the next step's first all-gather, a collective of
this group that no abort of the job's group reaches. So a worker that goes to a recovery cuts
this group (:meth:`NodeGroup.cut`: its sockets shut down; on NCCL its own communicator aborted,
which does not wake a peer's kernel: there the abort watch's fallback frees the peer): a local
peer waiting in it fails at once and recovers too. Work a peer completed stays complete
(what was sent arrives before the end of the stream), so a commit both made holds on both. In
the next group they enter, the node's workers learn in the layout check whether one of them cut
it, and then make it anew, the same ``ProcessGroup`` object for FSDP2 being impossible: the
holders of the old one are pointed at the new one (``_sharded``).

A node's workers are the ranks ``rank // local_world_size`` of the job: ``rdzv run`` and torchrun
number a node's workers consecutively, and sharded training needs the same number of workers on
every node (``--nproc-per-node``).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import RendezvousParameterError
from ._abort import GroupSockets, abort_communicator
from ._group import SwitchError, entering_hooks, group_options, group_sockets

logger = logging.getLogger(__name__)

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
        self.backend = backend
        self.device_type = device_type
        self.timeout = timeout
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if device_type == "cuda" else torch.device("cpu")
        """Where this worker's tensors for the group's collectives live."""
        self.broken = False
        """Whether this worker cut the group since it was made (its node makes it anew)."""
        self._sockets = GroupSockets()
        self._check_layout()
        self.pg = self._make()
        first = dist.get_rank() - self.local_rank
        self.mesh = DeviceMesh(device_type, torch.arange(first, first + self.size,
                                                         dtype=torch.int),
                               mesh_dim_names=("shard",), _init_backend=False)
        self._register()

    def _make(self) -> dist.ProcessGroup:
        """A process group of the node's workers, through the job's store of the moment (a
        collective of the node's workers), its sockets recorded to be cut."""
        node = dist.get_rank() // self.size
        store = dist.PrefixStore(f"rdzv-node/{node}/", dist.distributed_c10d._get_default_store())
        pg = _c10d.ProcessGroup(store, self.local_rank, self.size)
        made: Any
        # (an abort meanwhile fails it too: it waits on the job's store, which may be gone)
        with self._sockets.recording(), group_sockets.recording(track=False):
            if self.backend == "nccl":  # (torch's stub asks for options; it has defaults)
                made = _c10d.ProcessGroupNCCL(  # type: ignore[call-arg]
                    store, self.local_rank, self.size)
                kind = _c10d.ProcessGroup.BackendType.NCCL
            else:
                made = _c10d.ProcessGroupGloo(store, self.local_rank, self.size, self.timeout)
                kind = _c10d.ProcessGroup.BackendType.GLOO
        pg._set_default_backend(kind)
        pg._register_backend(torch.device(self.device_type), kind, made)
        pg._set_group_name(self.NAME)
        return pg

    def _register(self) -> None:
        """Make the group's name resolve to it (torch's registry, the mesh's: what
        ``DeviceMesh.from_group`` does for a group torch has registered)."""
        _c10d._register_process_group(self.NAME, self.pg)
        self.mesh._dim_group_names = [self.NAME]
        self.mesh._pg_registry[self.NAME] = self.pg

    def cut(self) -> None:
        """This worker leaves a step for a recovery: fail whatever a local peer waits for in
        this group (see the module's docstring); the node makes it anew in its next group."""
        self.broken = True
        if self.backend == "nccl":
            abort_communicator(self.pg, self.device)
            return
        count = self._sockets.close_current()
        logger.debug("the node's group cut: %d socket(s) shut down", count)

    def entered(self) -> None:
        """In a group just entered (a collective of the job's workers): check its layout, make
        this group anew if one of the node's workers cut it, and register its name again (the
        new job group emptied torch's registry)."""
        if self._check_layout():
            self.broken = True  # (until made: a failure on the way leaves it to the next group)
            self.pg = self._make()
            self._sockets.forget_closed()
            self.broken = False
            logger.info("the node's group made anew (a worker of the node had cut it)")
        self._register()

    def _check_layout(self) -> bool:
        """SwitchError unless every node of the job's group runs as many workers as this one,
        numbered node by node; whether a worker of this node cut this group (an all_gather of
        three numbers per worker)."""
        mine = torch.tensor([dist.get_rank() % self.size == self.local_rank, self.size,
                             self.broken], dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        if any(not bool(t[0]) or int(t[1]) != self.size for t in everyone):
            raise SwitchError(
                "sharded training over node_mesh() needs the same number of workers on every "
                f"node (--nproc-per-node), all of them in the group: this node runs {self.size}, "
                f"the nodes run {sorted({int(t[1]) for t in everyone})}")
        first = dist.get_rank() - self.local_rank
        return any(bool(t[2]) for t in everyone[first:first + self.size])


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
