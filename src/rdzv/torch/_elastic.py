"""Training through membership changes without restarting: the worker side of in-process switches.

Under ``rdzv run`` a worker that creates an :class:`ElasticState` connects to its agent (the
channel named by ``RDZV_AGENT_CHANNEL``). When the agents have formed the next round in the
background they send each worker a *plan* (its new rank, world size and the new group's store)
and then a *switch step*. The new group's store is made ready in the background at once (global
rank 0 of the new group starts it, the others connect), and training goes on. At the switch
step, in :meth:`ElasticState.step_done`, every worker of the old group replaces its process
group with the new one (same process, fresh store prefix), global rank 0 sends the state to
the newcomers, and the ``on_change`` callbacks rebuild what depends on the group (DDP). A worker
of a leaving node stops its loop there instead.

Under torchrun, or when a change cannot be made in-process, the agent restarts the workers as
before: the same script then resumes from its checkpoint.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..agent._channel import ENV_CHANNEL, ENV_JOIN, ChannelClient
from ..errors import RendezvousError, RendezvousParameterError
from ._statesync import receive_state, send_state

logger = logging.getLogger(__name__)

STORE_TIMEOUT = timedelta(minutes=5)
"""How long the new group's store waits for its members (the agents' switch timeout is lower)."""


class SwitchError(RendezvousError):
    """This worker could not move to the new process group; its agent restarts the workers."""


class _AgentLink:
    """This worker's connection to its agent, shared by init and :class:`ElasticState`."""

    def __init__(self, path: str) -> None:
        self.state: ElasticState | None = None
        self._early: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.client = ChannelClient(path, int(os.environ.get("LOCAL_RANK", "0")), self._on)

    def _on(self, message: dict[str, Any]) -> None:
        with self._lock:
            state = self.state
            if state is None:
                self._early.append(message)
                return
        state._on_agent(message)

    def attach(self, state: "ElasticState") -> None:
        with self._lock:
            self.state, early, self._early = state, self._early, []
        for message in early:
            state._on_agent(message)

    def send(self, message: dict[str, Any]) -> None:
        self.client.send(message)


_link: _AgentLink | None = None


def agent_link() -> _AgentLink | None:
    """The connection to this worker's rdzv agent (None when not started by ``rdzv run``)."""
    global _link
    path = os.environ.get(ENV_CHANNEL)
    if _link is None and path:
        _link = _AgentLink(path)
    return _link


def group_store(addr: str, port: int, rank: int, world_size: int) -> dist.Store:
    """The TCPStore of a group created in-process (global rank 0 serves it)."""
    return dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=STORE_TIMEOUT,
                         wait_for_workers=False)


def init_group(backend: str, store: dist.Store, prefix: str, rank: int, world_size: int,
               timeout: timedelta) -> None:
    """Start the default process group on ``store`` under the round's own ``prefix``."""
    dist.init_process_group(backend, store=dist.PrefixStore(f"{prefix}/", store), rank=rank,
                            world_size=world_size, timeout=timeout)


def join_running_group(backend: str, timeout: timedelta, **kwargs: Any) -> tuple[int, int]:
    """A newcomer's start: tell the agent it is up (warm), then wait in the new group's
    creation until the running workers switch to it."""
    link = agent_link()
    if link is None:
        raise RendezvousParameterError(
            f"{ENV_JOIN} is set but {ENV_CHANNEL} is not: both come from `rdzv run`; do not "
            "set them by hand")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = group_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank,
                        world_size)
    if kwargs:
        raise RendezvousParameterError(f"joining a running group takes no {sorted(kwargs)}")
    init_group(backend, store, os.environ[ENV_JOIN], rank, world_size, timeout)
    return rank, world_size


class ElasticState:
    """The training state that moves with the job through membership changes, in-process.

    Give it what a newcomer must receive from a running worker: ``model`` (a module),
    ``optimizer`` and ``step`` (the number of completed steps), plus any values (numbers,
    strings, lists, dicts, tensors) as keywords, read back from :attr:`values`. Create it after
    ``rdzv.torch.init_process_group()`` and before anything else that uses the process group
    (DDP): on a newcomer the constructor receives the state from global rank 0.

    Drive the loop with ``for step in state.steps(total)`` (or call :meth:`step_done` after
    each step). Register :meth:`on_change` callbacks to rebuild what holds the old process
    group (DDP, a sampler): they run after every switch, with :attr:`rank` and
    :attr:`world_size` already updated. After the loop, :attr:`left` says whether this node
    left the job (its process group is gone then).
    """

    def __init__(self, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, step: int = 0,
                 **values: Any) -> None:
        if not dist.is_initialized():
            raise RendezvousParameterError(
                "ElasticState needs torch.distributed started first: call "
                "rdzv.torch.init_process_group() in a worker started by `rdzv run` or torchrun")
        self.model = model
        self.optimizer = optimizer
        self.step = int(step)
        self.values: dict[str, Any] = dict(values)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.left = False
        self.received = False
        """Whether this worker joined a running group and got the state from a peer (else the
        caller restores it, e.g. from a checkpoint)."""
        self.switches = 0
        self._backend = str(dist.get_backend())
        self._timeout = timedelta(minutes=10)
        self._callbacks: list[Callable[[ElasticState], None]] = []
        self._switch_at: int | None = None
        self._receivers: list[int] = []
        self._checked = self.step
        self._plan: dict[str, Any] | None = None
        self._store: Future[dist.Store] | None = None
        self._last: float | None = None
        self._step_time: float | None = None
        self._link = agent_link()
        if os.environ.get(ENV_JOIN) and self._link is not None:
            started = time.perf_counter()
            self._apply(receive_state(0, self._device()))
            self.received = True
            self._checked = self.step
            self._link.send({"op": "switched", "ms": (time.perf_counter() - started) * 1000})
        if self._link is not None:
            self._link.attach(self)

    # -- the loop ---------------------------------------------------------------------------
    def on_change(self, callback: Callable[["ElasticState"], None]) -> Callable[..., None]:
        """Run ``callback(state)`` after each switch to a new group (usable as a decorator)."""
        self._callbacks.append(callback)
        return callback

    def steps(self, total: int) -> Iterator[int]:
        """The step numbers from :attr:`step` to ``total`` (exclusive), switching between steps
        when the job changes; ends early if this node leaves the job."""
        while self.step < total and not self.left:
            yield self.step
            self.step_done()

    def step_done(self) -> None:
        """Count a completed step; at the agreed step, switch to the new group (or leave).

        Costs an attribute check unless a switch is due (see ``bench/membership.py``)."""
        self.step += 1
        now = time.perf_counter()
        if self._last is not None:
            elapsed = now - self._last
            self._step_time = elapsed if self._step_time is None else (
                0.8 * self._step_time + 0.2 * elapsed)
        self._last = now
        self._checked = self.step
        if self._switch_at is not None and self.step >= self._switch_at:
            self._at_switch_step()

    @property
    def step_time(self) -> float | None:
        """Recent seconds per step (a moving average), None before two steps."""
        return self._step_time

    # -- switching ----------------------------------------------------------------------------
    def _on_agent(self, message: dict[str, Any]) -> None:
        """A message of the agent (on the channel's thread)."""
        op = message["op"]
        if op == "query":
            self._send({"op": "progress", "step": self._checked, "step_time": self._step_time})
        elif op == "plan":
            self._plan = message
            if not message.get("leave"):
                self._store = Future()
                threading.Thread(target=self._prepare, args=(message, self._store),
                                 daemon=True, name="rdzv-next-group").start()
        elif op == "switch":
            self._receivers = [int(r) for r in message.get("receivers", [])]
            self._switch_at = int(message["step"])
            if self._checked > self._switch_at:
                self._send({"op": "missed", "step": self._checked})

    @staticmethod
    def _prepare(plan: dict[str, Any], future: "Future[dist.Store]") -> None:
        try:
            future.set_result(group_store(str(plan["master_addr"]), int(plan["master_port"]),
                                          int(plan["rank"]), int(plan["world_size"])))
        except Exception as exc:  # handed to the switch, which reports it
            future.set_exception(exc)

    def _at_switch_step(self) -> None:
        target, plan = self._switch_at, self._plan
        self._switch_at = None
        if target is None or self.step > target:
            self._send({"op": "missed", "step": self.step})
            return
        started = time.perf_counter()
        try:
            if plan is None:
                raise SwitchError("the agent announced a switch without a plan")
            if plan.get("leave"):
                dist.destroy_process_group()
                self.left = True
            else:
                self._switch(plan)
        except Exception as exc:
            self._send({"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
            if isinstance(exc, SwitchError):
                raise
            raise SwitchError(f"cannot switch to the new process group: {exc}") from exc
        elapsed = (time.perf_counter() - started) * 1000
        self._last = time.perf_counter()  # the pause is not a step
        self.switches += 1
        self._send({"op": "switched", "ms": elapsed, "left": self.left})

    def _switch(self, plan: dict[str, Any]) -> None:
        assert self._store is not None
        store = self._store.result(timeout=STORE_TIMEOUT.total_seconds())
        rank, world_size = int(plan["rank"]), int(plan["world_size"])
        dist.destroy_process_group()
        init_group(self._backend, store, str(plan["prefix"]), rank, world_size, self._timeout)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                          GROUP_RANK=str(plan["group_rank"]),
                          MASTER_ADDR=str(plan["master_addr"]),
                          MASTER_PORT=str(plan["master_port"]))
        self.rank, self.world_size = rank, world_size
        if rank == 0 and self._receivers:
            sent = send_state(self._tree(), self._receivers, self._device())
            logger.info("sent %d bytes of state to ranks %s", sent, self._receivers)
        for callback in self._callbacks:
            callback(self)

    # -- the state ----------------------------------------------------------------------------
    def _tree(self) -> dict[str, Any]:
        return {"step": self.step, "values": self.values,
                "model": dict(self.model.state_dict()) if self.model is not None else None,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def _apply(self, tree: Any) -> None:
        try:
            if self.model is not None:
                self.model.load_state_dict(tree["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(tree["optimizer"])
            self.step = int(tree["step"])
            self.values.update(tree["values"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise SwitchError(f"the state received from global rank 0 does not fit this "
                              f"worker's model and optimizer (is every node running the same "
                              f"program?): {exc}") from exc

    def _device(self) -> torch.device:
        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _send(self, message: dict[str, Any]) -> None:
        if self._link is not None:
            self._link.send(message)
