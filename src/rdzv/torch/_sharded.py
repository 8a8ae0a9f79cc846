"""Sharded models in :class:`ElasticState`: HSDP whose replicas follow membership in-process.

Each node shards the model among its own workers (FSDP2's ``fully_shard`` over
:func:`node_mesh`, kept across changes, see ``_nodegroup``) and holds one replica of it; the
replicas are the nodes of the job. What FSDP2 does within a node does not change with
membership. What spans nodes is done here, anew for every group:

* the **replica group** of each worker: the workers with its local rank on every node
  (``dist.new_group`` for each local rank, in the job's group), over which the gradients' shards
  are averaged before each optimizer step (:meth:`Sharded.reduce`: one all_reduce per bucket,
  what HSDP's replicate dimension does), followed by a one-number all_reduce among the node's
  workers, the **commit**: a node applies a step on all its shards or on none, so that a node
  lost mid-step leaves survivors that each hold a whole state (``_agreement.agree`` takes its
  source among them);
* the **state** a newcomer receives: this worker's shard of the model and optimizer (DCP's
  sharded state dicts, their DTensors as local tensors), sent by the worker of the same local
  rank on the source node: all local ranks in parallel, over the new group.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from ..errors import RendezvousParameterError
from ._group import GroupLost, group_sockets
from ._nodegroup import NodeGroup, node_group

logger = logging.getLogger(__name__)

BUCKET = 32 << 20
"""Bytes of gradients reduced over the replicas by one all_reduce."""


class Sharded:
    """What :class:`ElasticState` does for a model sharded over :func:`node_mesh`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        group = node_group[0] if node_group else None
        meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
        if group is None or meshes != {group.mesh}:
            raise RendezvousParameterError(
                "ElasticState holds a model sharded over another device mesh: shard it over "
                "rdzv.torch.node_mesh() (fully_shard(module, mesh=rdzv.torch.node_mesh())), "
                "the mesh whose replicas follow the job's membership")
        self.node: NodeGroup = group
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.replicas: dist.ProcessGroup | None = None
        self.count = 1
        self.reduced = False
        """Whether this step's gradients were reduced already (an explicit call before
        clipping)."""
        self.committed = False
        """Whether this step's commit was made (then a failure needs no word to the node)."""
        self.quiet = False
        """While the state is prepared for a transfer: an optimizer step then is no training
        step (DCP's initialisation of an empty optimizer state)."""
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_step)

    # -- every group ------------------------------------------------------------------------
    def enter(self) -> None:
        """In a group just entered (a collective of every worker): make this worker's replica
        group (the node group checked already that every node runs as many workers)."""
        size = self.node.size
        nodes = dist.get_world_size() // size
        with group_sockets.recording():  # an abort shuts their sockets down too
            groups = [dist.new_group([n * size + part for n in range(nodes)])
                      for part in range(size)]
        self.replicas = groups[self.node.local_rank]
        self.count = nodes
        self.reduced = self.committed = False

    # -- every step ---------------------------------------------------------------------------
    def _before_step(self, *_: Any) -> None:
        if not self.quiet:
            self.reduce()
        self.reduced = self.committed = False

    def reduce(self) -> None:
        """Average this worker's gradient shards over the replicas, then commit: every worker
        of the node learns whether all of them could, and a node applies the step on every
        shard or on none (GroupLost: the group failed). Called before the optimizer's step (or
        before clipping the gradients, by :meth:`ElasticState.reduce_gradients`)."""
        if self.reduced or self.count == 1:  # (one node: no replica to agree with)
            return
        error: BaseException | None = None
        try:
            self._all_reduce([p.grad.to_local() for p in self.params  # type: ignore[attr-defined]
                              if p.grad is not None])
        except Exception as exc:  # the replica group failed: the node must not apply the step
            error = exc
        self.committed = True
        if not self._commit(error is None):
            raise error or GroupLost("another worker of this node could not complete its step: "
                                     "the node applies it nowhere")
        self.reduced = True

    def _commit(self, done: bool) -> bool:
        """Whether every worker of the node completed its step (a 4-byte all_reduce among
        them)."""
        flag = torch.tensor([int(done)], dtype=torch.int32, device=self.node.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.node.pg)
        return bool(flag.item())

    def abandon(self) -> None:
        """The step failed under this worker before its commit (a collective of the job's group
        failed): the node's other workers may wait in the commit, having completed that
        collective; say no to them (the node applies the step nowhere). Nothing if the commit
        was made; if a local peer is gone the commit fails at once, and nobody waits."""
        committed, self.committed = self.committed, False
        if committed or self.count == 1:
            return
        try:
            self._commit(False)
        except Exception as exc:  # a local peer gone: nobody waits
            logger.debug("the node's commit after a failed step: %s", exc)

    def _all_reduce(self, grads: list[torch.Tensor]) -> None:
        """Sum ``grads`` over the replicas and divide by their count, in buckets of one dtype."""
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for grad in sorted(grads, key=lambda g: str(g.dtype)):
            nbytes = grad.numel() * grad.element_size()
            if not buckets or buckets[-1][0].dtype != grad.dtype or size + nbytes > BUCKET:
                buckets.append([])
                size = 0
            buckets[-1].append(grad)
            size += nbytes
        for bucket in buckets:
            if len(bucket) == 1 and bucket[0].is_contiguous():  # a large one: in place
                dist.all_reduce(bucket[0], group=self.replicas)
                bucket[0].div_(self.count)
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.replicas)
            flat /= self.count
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    # -- the state ----------------------------------------------------------------------------
    def tree(self) -> dict[str, Any]:
        """This worker's shard of the model and optimizer (DCP's sharded state dicts, each
        DTensor as its local tensor)."""
        model_state, optimizer_state = self._state_dicts()
        return {"model": _local(model_state), "optimizer": _local(optimizer_state)}

    def apply(self, tree: dict[str, Any]) -> None:
        """Load a shard received from the worker of the same local rank on the source node (in
        place, into the tensors FSDP2 and the optimizer hold)."""
        model_state, optimizer_state = self._state_dicts()
        _copy(model_state, tree["model"], "model")
        _copy(optimizer_state, tree["optimizer"], "optimizer")
        if self.optimizer is not None:
            for group, received in zip(self.optimizer.param_groups,
                                       tree["optimizer"]["param_groups"]):
                group.update({k: v for k, v in received.items() if k != "params"})

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.optimizer is None:
            return get_state_dict(self.model, [])[0], {}
        self.quiet = True  # DCP steps an empty optimizer once to create its state
        try:
            return get_state_dict(self.model, self.optimizer)  # type: ignore[return-value]
        finally:
            self.quiet = False


def _local(node: Any) -> Any:
    if isinstance(node, DTensor):
        return node.to_local()
    if isinstance(node, dict):
        return {key: _local(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_local(value) for value in node)
    return node


def _copy(mine: Any, received: Any, where: str) -> None:
    """Copy every tensor of ``received`` into the tensor at the same place of ``mine``."""
    if isinstance(mine, (torch.Tensor, DTensor)):
        target = mine.to_local() if isinstance(mine, DTensor) else mine
        if not isinstance(received, torch.Tensor) or target.shape != received.shape:
            raise ValueError(f"the shard received for {where} does not fit this worker's "
                              f"({getattr(received, 'shape', type(received).__name__)} for "
                              f"{tuple(target.shape)}): is every node running the same program "
                              "with as many workers?")
        with torch.no_grad():
            target.copy_(received)
    elif isinstance(mine, dict):
        if not isinstance(received, dict) or set(mine) != set(received):
            raise ValueError(f"the shard received for {where} holds other entries than this "
                              "worker's: is every node running the same program?")
        for key, value in mine.items():
            _copy(value, received[key], f"{where}.{key}")
    elif isinstance(mine, (list, tuple)) and any(
            isinstance(v, (torch.Tensor, dict, list, tuple)) for v in mine):
        for index, value in enumerate(mine):
            _copy(value, received[index], f"{where}[{index}]")

