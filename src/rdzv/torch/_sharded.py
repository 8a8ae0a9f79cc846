"""Sharded models in :class:`ElasticState`: HSDP whose replicas follow membership in-process.

Each node shards the model among its own workers (FSDP2's ``fully_shard`` over
:func:`node_mesh`, kept across changes, see ``_nodegroup``) and holds one replica of it; the
replicas are the nodes of the job. What FSDP2 does within a node does not change with
membership. What spans nodes is done here, anew for every group:

* the **replica group** of each worker: the workers with its local rank on every node
  (``dist.new_group`` for each local rank, in the job's group), over which the gradients' shards
  are averaged before each optimizer step (:meth:`Sharded.reduce`: one all_reduce per bucket,
  what HSDP's replicate dimension does), followed by a three-number all_reduce among the node's
  workers, the **commit**: a node applies a step on all its shards or on none, so that a node
  lost mid-step leaves survivors that each hold a whole state (``_agreement.agree`` takes its
  source among them). The commit also says which of its agent's plans every worker of the node
  holds (:meth:`Sharded.agreement`): a planned switch is taken by the node's workers at one
  step boundary or by none of them (see ``_elastic.due``). A worker that goes to a recovery
  cuts the node's group (its local peers' commit, or any wait of theirs in it, fails at once;
  see ``_nodegroup``), and when the node makes it anew, FSDP2's references to it are pointed at
  the new one (:func:`_repoint`);
* the **state** a newcomer receives: this worker's shard of the model and optimizer (DCP's
  sharded state dicts, their DTensors as local tensors), sent by the worker of the same local
  rank on the source node: all local ranks in parallel, over the new group.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FSDPModule
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
        self._pg = group.pg
        """The node group FSDP2 holds (the node may have made a new one since)."""
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.replicas: dist.ProcessGroup | None = None
        self.count = 1
        self.reduced = False
        """Whether this step's gradients were reduced already (an explicit call before
        clipping)."""
        self.quiet = False
        """While the state is prepared for a transfer: an optimizer step then is no training
        step (DCP's initialisation of an empty optimizer state)."""
        self.held: Callable[[], int] | None = None
        """Under ``rdzv run``: the round of the switch this worker's agent planned and the
        worker has not taken yet (-1: none)."""
        self._agreed: int | None = None
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_step)

    def prepare(self) -> None:
        """On a newcomer, before it joins: make the optimizer's state (DCP steps it once with
        no effect), which is slow the first time in a process (DTensor's sharding propagation
        of every optimizer op; ~0.25 s for a small model on 2 CPU cores) and would otherwise
        pause the running workers, who wait for the newcomer to receive its shards and for its
        first optimizer step."""
        self._state_dicts()

    # -- every group ------------------------------------------------------------------------
    def enter(self) -> None:
        """In a group just entered (a collective of every worker): make this worker's replica
        group (the node group checked already that every node runs as many workers, and made
        itself anew if one of them cut it: FSDP2 then uses the new one)."""
        if self._pg is not self.node.pg:
            _repoint(self.model, self._pg, self.node.pg)
            self._pg = self.node.pg
        size = self.node.size
        nodes = dist.get_world_size() // size
        with group_sockets.recording():  # an abort shuts their sockets down too
            groups = [dist.new_group([n * size + part for n in range(nodes)])
                      for part in range(size)]
        self.replicas = groups[self.node.local_rank]
        self.count = nodes
        self.reduced = False

    # -- every step ---------------------------------------------------------------------------
    def _before_step(self, *_: Any) -> None:
        if not self.quiet:
            self.reduce()
        self.reduced = False

    def reduce(self) -> None:
        """Average this worker's gradient shards over the replicas, then commit: every worker
        of the node learns whether all of them could, and a node applies the step on every
        shard or on none (GroupLost: the group failed). Called before the optimizer's step (or
        before clipping the gradients, by :meth:`ElasticState.reduce_gradients`)."""
        if self.reduced:
            return
        if self.count == 1:  # one node: no replica to agree with, only on the agent's plan
            if self.held is not None and self.node.size > 1:
                self._commit(True)
                self.reduced = True
            return
        error: BaseException | None = None
        try:
            self._all_reduce([p.grad.to_local() for p in self.params  # type: ignore[attr-defined]
                              if p.grad is not None])
        except Exception as exc:  # the replica group failed: the node must not apply the step
            error = exc
        if not self._commit(error is None):
            raise error or GroupLost("another worker of this node could not complete its step: "
                                     "the node applies it nowhere")
        self.reduced = True

    def _commit(self, done: bool) -> bool:
        """Whether every worker of the node completed its step, and which plan all of them
        hold (:meth:`agreement`): one all_reduce of three numbers among them."""
        held = self.held() if self.held is not None else -1
        flags = torch.tensor([int(done), held, -held], dtype=torch.int64, device=self.node.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.node.pg)
        completed, lowest, highest = (int(value) for value in flags.tolist())
        self._agreed = lowest if lowest == -highest else -1
        return bool(completed)

    def agreement(self) -> int | None:
        """The round of the plan every worker of the node held at the commit since the last
        call (-1: not one plan for all, or none), None if there was no commit (a step without
        the optimizer's, or torchrun)."""
        agreed, self._agreed = self._agreed, None
        return agreed

    def abandon(self) -> None:
        """This worker leaves its step for a recovery (a collective failed under it, or it took
        a recovery's plan at the step's end): cut the node's group, so a local peer waiting in
        its commit or in the next step's all-gather fails at once and recovers too."""
        self.reduced = False
        self.node.cut()
        _reset_iterations(self.model)

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


def _repoint(model: torch.nn.Module, old: dist.ProcessGroup, new: dist.ProcessGroup) -> None:
    """Point FSDP2's references to the node group ``old`` (its mesh infos, made once at
    ``fully_shard``, of every parameter group and parameter) at ``new``."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            holders: list[Any] = [group, *group.fsdp_params]
            infos = {id(info): info for holder in holders
                     for info in (holder.mesh_info, holder.post_forward_mesh_info)
                     if info is not None}
            # (and the communication hooks that keep a group: memory allocated from it)
            keepers = [*infos.values(), group._all_gather_comm, group._reduce_scatter_comm]
            for keeper in keepers:
                for name in ("shard_process_group", "reduce_scatter_process_group", "_group"):
                    if getattr(keeper, name, None) is old:
                        setattr(keeper, name, new)


def _reset_iterations(model: torch.nn.Module) -> None:
    """FSDP2's per-step state after a step that an exception left mid-way (its roots'
    ``reset_iter_state``: trackers cleared, parameters resharded), so the next step starts as
    a first one."""
    for root in _roots(model):
        try:
            root.reset_iter_state()
        except Exception as exc:  # (not FSDP2's root, or its pending work failed with the group)
            logger.warning("resetting FSDP2's step state after the failure: %s", exc)


def _roots(module: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules of ``module`` that no other one contains (FSDP2's roots)."""
    if isinstance(module, FSDPModule):
        return [module]
    return [root for child in module.children() for root in _roots(child)]


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

