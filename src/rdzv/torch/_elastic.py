"""Training through membership changes without restarting: the worker side of in-process changes.

Under ``rdzv run`` a worker that creates an :class:`ElasticState` connects to its agent (the
channel named by ``RDZV_AGENT_CHANNEL``).

*A planned change* (a node joins or leaves): when the agents have formed the next round in the
background they send each worker a *plan* (its new rank, world size and the new group's store)
and then a *switch step*. The new group's store is made ready in the background at once, and
training goes on. At the switch step, in :meth:`ElasticState.step_done`, every worker of the old
group replaces its process group with the new one (same process, fresh store prefix), global
rank 0 sends the state to the newcomers, and the ``on_change`` callbacks rebuild what depends on
the group (DDP). A worker of a leaving node stops its loop there instead.

*A lost member*: a collective fails (the dead peer's connections closed) or the agent aborts the
group (a hung peer, :mod:`._abort`). :meth:`ElasticState.run` catches the failure, tells the
agent the step it completed, and waits while the agents form the next round without the lost
node. Then every survivor enters the new group and adopts the state of the survivor that
completed the most steps (sent to the others over the new group), and ``train`` runs again from
there: at most the failed step is done again, by the survivors that had not finished it.

Under torchrun, or when a change cannot be made in-process, the agent restarts the workers as
before: the same script then resumes from its checkpoint.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from .._channel import ENV_JOIN
from ..errors import RendezvousError, RendezvousParameterError
from ._group import STORE_TIMEOUT, agent_link, group_sockets, group_store, init_group
from ._statesync import receive_state, send_state

logger = logging.getLogger(__name__)

T = TypeVar("T")
WAIT_SLICE = 1.0
"""Seconds between checks that the agent is still there, while waiting for its decision."""
PEER_FAILURE_WORDS = ("gloo", "NCCL", "Connection closed", "Connection reset")
"""What the message of a collective that failed because a peer is gone contains."""
PLAN_ENV = {"RANK": "rank", "WORLD_SIZE": "world_size", "GROUP_RANK": "group_rank",
            "GROUP_WORLD_SIZE": "group_world_size", "ROLE_RANK": "role_rank",
            "ROLE_WORLD_SIZE": "role_world_size", "MASTER_ADDR": "master_addr",
            "MASTER_PORT": "master_port"}
"""The variables ``rdzv run`` gives a worker, updated from the plan of each new group."""


class SwitchError(RendezvousError):
    """This worker could not move to the new process group; its agent restarts the workers."""


class ElasticState:
    """The training state that moves with the job through membership changes, in-process.

    Give it what a newcomer must receive from a running worker: ``model`` (a module),
    ``optimizer`` and ``step`` (the number of completed steps), plus any values (numbers,
    strings, lists, dicts, tensors) as keywords, read back from :attr:`values`. Create it after
    ``rdzv.torch.init_process_group()`` and before anything else that uses the process group
    (DDP): on a newcomer the constructor receives the state from a running worker.

    Drive the loop with ``for step in state.steps(total)`` (or call :meth:`step_done` after
    each step), inside a function given to :meth:`run` so that the loss of a node is survived
    in-process. Register :meth:`on_change` callbacks to rebuild what holds the old process
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
        self.recoveries = 0
        self._backend = str(dist.get_backend())
        self._callbacks: list[Callable[[ElasticState], None]] = []
        self._switch_at: int | None = None
        self._checked = self.step
        self._plan: dict[str, Any] | None = None
        self._store: Future[dist.Store] | None = None
        self._decision: dict[str, Any] | None = None
        self._decided = threading.Event()
        self._agent_gone = False
        self._aborted = False
        self._last: float | None = None
        self._step_time: float | None = None
        self._link = agent_link()
        if self._link is not None:
            self._link.attach(self)
        if os.environ.get(ENV_JOIN) and self._link is not None:
            started = time.perf_counter()
            decision = self._wait_decision("join")
            self._apply(receive_state(int(decision["source"]), self._device()))
            self.received = True
            self._checked = self.step
            self._send({"op": "switched", "ms": (time.perf_counter() - started) * 1000})

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

    def run(self, train: Callable[[], T]) -> T:
        """Call ``train()`` (the training loop) and return what it returns; when a member of the
        group is lost while it runs, recover in-process and call it again.

        ``train`` resumes from :attr:`step`: write the loop as ``for step in
        state.steps(total)``. Put every collective of a step before ``optimizer.step()`` (DDP's
        backward, a logged loss' all_reduce): then a failed step was applied on no worker or,
        complete, on some, and the survivors go on from the most advanced one. An error that is
        not a group failure, or a recovery the agents give up, is raised as it is.
        """
        while True:
            try:
                return train()
            except Exception as exc:
                if self._link is None or not self._group_failure(exc):
                    raise
                self._recover(exc)

    @property
    def step_time(self) -> float | None:
        """Recent seconds per step (a moving average), None before two steps."""
        return self._step_time

    # -- what the agent says (on the channel's thread) -------------------------------------
    def on_agent(self, message: dict[str, Any]) -> None:
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
            self._decision = message
            self._switch_at = int(message["step"])
            if self._checked > self._switch_at:
                self._send({"op": "missed", "step": self._checked})
        elif op == "abort":
            self._aborted = True
            aborted = group_sockets.abort()
            logger.warning("a member of the group is lost: aborted the group (%d sockets)", aborted)
        elif op in ("recover", "join"):
            self._decision = message
            self._decided.set()
        elif op == "closed":
            self._agent_gone = True
            self._decided.set()

    @staticmethod
    def _prepare(plan: dict[str, Any], future: "Future[dist.Store]") -> None:
        try:
            future.set_result(group_store(str(plan["master_addr"]), int(plan["master_port"]),
                                          int(plan["rank"]), int(plan["world_size"])))
        except Exception as exc:  # handed to the switch, which reports it
            future.set_exception(exc)

    # -- a planned switch ----------------------------------------------------------------------
    def _at_switch_step(self) -> None:
        target, plan, decision = self._switch_at, self._plan, self._decision
        self._switch_at = None
        if target is None or self.step > target:
            self._send({"op": "missed", "step": self.step})
            return
        started = time.perf_counter()
        try:
            if plan is None or decision is None:
                raise SwitchError("the agent announced a switch without a plan")
            if self._backend == "nccl":
                torch.cuda.synchronize()  # the step's last kernels, before the group goes
            dist.destroy_process_group()
            if plan.get("leave"):
                self.left = True
            else:
                self._enter(plan, decision)
        except Exception as exc:
            self._send({"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
            if isinstance(exc, SwitchError):
                raise
            raise SwitchError(f"cannot switch to the new process group: {exc}") from exc
        self.switches += 1
        self._switched(started)

    def _enter(self, plan: dict[str, Any], decision: dict[str, Any]) -> None:
        """Create the new group of ``plan`` and move the state as ``decision`` says."""
        assert self._store is not None
        store = self._store.result(timeout=STORE_TIMEOUT.total_seconds())
        rank, world_size = int(plan["rank"]), int(plan["world_size"])
        init_group(self._backend, store, str(plan["prefix"]), rank, world_size)
        os.environ.update({name: str(plan[key]) for name, key in PLAN_ENV.items()})
        self.rank, self.world_size = rank, world_size
        source = int(decision.get("source", 0))
        receivers = [int(r) for r in decision.get("receivers", [])]
        if rank == source and receivers:
            sent = send_state(self._tree(), receivers, self._device())
            logger.info("sent %d bytes of state to ranks %s", sent, receivers)
        elif rank in receivers:
            self._apply(receive_state(source, self._device()))
        for callback in self._callbacks:
            callback(self)

    def _switched(self, started: float) -> None:
        elapsed = (time.perf_counter() - started) * 1000
        self._last = time.perf_counter()  # the pause is not a step
        self._send({"op": "switched", "ms": elapsed, "left": self.left})

    # -- a lost member ---------------------------------------------------------------------
    def _group_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the group failing under this worker (not a bug of its own)."""
        if self._aborted or isinstance(exc, dist.DistError):
            return True
        return isinstance(exc, RuntimeError) and any(w in str(exc) for w in PEER_FAILURE_WORDS)

    def _recover(self, exc: BaseException) -> None:
        started = time.perf_counter()
        self._decision = None
        self._decided.clear()
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        logger.warning("the process group failed at step %d (%s: %s); waiting for the agents",
                       self.step, type(exc).__name__, first_line)
        self._send({"op": "broken", "step": self.step, "error": first_line})
        group_sockets.abort()
        try:
            dist.destroy_process_group()
        except Exception as error:  # a broken group may not even tear down cleanly
            logger.warning("destroying the failed group: %s", error)
        decision = self._wait_decision("recover")
        plan = self._plan
        if plan is None:
            raise SwitchError("the agent sent no plan for the new group") from exc
        self._aborted = False
        try:
            self._enter(plan, decision)
        except Exception as error:
            self._send({"op": "failed", "error": f"{type(error).__name__}: {error}"})
            raise SwitchError(f"cannot recover in the new process group: {error}") from error
        self.recoveries += 1
        self._checked = self.step
        self._switched(started)

    def _wait_decision(self, op: str) -> dict[str, Any]:
        """The agents' ``op`` decision (``recover``/``join``); SwitchError if they restart the
        workers instead or this worker's agent is gone. No deadline of its own: the agent bounds
        every transition and stops its workers when one fails."""
        while not self._decided.wait(WAIT_SLICE):
            pass
        decision = self._decision
        if self._agent_gone or decision is None:
            raise SwitchError("this worker's rdzv agent is gone")
        if decision["op"] != op:
            raise SwitchError(f"the agent sent {decision['op']!r} while this worker waited for "
                              f"{op!r}")
        return decision

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
            raise SwitchError(f"the state received from a peer does not fit this worker's model "
                              f"and optimizer (is every node running the same program?): "
                              f"{exc}") from exc

    def _device(self) -> torch.device:
        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _send(self, message: dict[str, Any]) -> None:
        if self._link is not None:
            self._link.send(message)
