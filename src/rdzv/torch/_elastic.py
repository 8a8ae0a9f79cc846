"""Training through membership changes without restarting: the worker side of in-process changes.

Under ``rdzv run`` a worker that creates an :class:`ElasticState` connects to its agent (the
channel named by ``RDZV_AGENT_CHANNEL``), reports its progress now and then, and follows the
plans its agent sends, each the decision of a round for this worker (``rdzv._messages.Plan``):

* ``switch`` (a node joins or leaves): at the end of the planned step, in
  :meth:`ElasticState.step_done`, the worker replaces its process group with the new one (same
  process, fresh store prefix), the group agrees on its state (below) and the ``on_change``
  callbacks rebuild what depends on the group (DDP). A worker already past the step moves at its
  next step boundary; one whose group failed meanwhile moves at once. A node that shards the
  model moves its workers at one boundary (:func:`due`).
* ``leave`` (its node leaves): the worker stops its loop at the planned step.
* ``recover`` (a member was lost): the agent aborts the group first, so a collective waiting on
  the lost peer fails at once; :meth:`ElasticState.run` catches the failure, reports the step
  it completed and enters the new group, and ``train`` runs again from the agreed state.

On entering a group every worker gathers every worker's step and state digest and the group
follows one rule (``_agreement.agree``): the most advanced state is kept (a step completed on
some survivors is never undone) and every worker whose state differs receives it; the digests
are compared again after the transfer, so no group trains on with parameters that differ. Under
torchrun, or when a change cannot be made in-process, the agent restarts the workers as before:
the same script then resumes from its checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from .._messages import (
    PROGRESS_EVERY,
    Broken,
    Entered,
    Failed,
    Left,
    Plan,
    PlanKind,
    Progress,
    Shards,
    Where,
)
from ..errors import RendezvousParameterError
from ._agreement import StateMismatch, reach_one_state
from ._group import (
    AgentLink,
    GroupLost,
    SwitchError,
    agent_link,
    enter_group,
    first_line,
    group_sockets,
    join_running_group,
    joined_plan,
    leave_group,
    provisional,
)
from ._steptime import StepTimer, mean_step

if TYPE_CHECKING:
    from ._sharded import Sharded

logger = logging.getLogger(__name__)

T = TypeVar("T")
PEER_FAILURE_WORDS = ("gloo", "NCCL", "Connection closed", "Connection reset")
"""What the message of a collective that failed because a peer is gone contains."""


def due(plan: Plan, step: int, agreed: int | None) -> bool:
    """Whether a worker at the end of its ``step`` acts on its agent's ``plan`` now.

    A recovery: at once (its group is broken). A leave: from the planned step on (a local peer
    that goes on into the next step is freed when the leaver's process ends). A switch: from
    the planned step on, and in a node that shards the model only if every worker of the node
    held this plan at the step's commit (``agreed``: the round they all held, -1 if not one for
    all; None where the step had no commit: the step rule alone). A worker that heard of the
    plan a moment later than a local peer would otherwise go on into the next step and wait
    there, in the node's group, for the peer that moved, until the switch's timeout. Held back,
    the node's workers move together at a later boundary: the next commit, or (the other nodes
    moved on) the failure of their next step in the old group, after which they enter the
    planned group as a recovery would.
    """
    if plan.kind is PlanKind.RECOVER or plan.step is None:
        return True
    if step < plan.step:
        return False
    return plan.kind is PlanKind.LEAVE or agreed is None or agreed == plan.round


def _shards_of(model: torch.nn.Module | None,
               optimizer: torch.optim.Optimizer | None) -> Sharded | None:
    """What a model with DTensor parameters (FSDP2's ``fully_shard``) needs on every change;
    None for a replicated model. DTensor is looked up, not imported: a program whose model holds
    DTensors has imported it, and importing it with DCP costs every other worker's start
    half a second."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if model is None or dtensor is None or not any(
            isinstance(p, dtensor) for p in model.parameters()):
        return None
    from ._sharded import Sharded  # (deferred, as above)

    return Sharded(model, optimizer)


class ElasticState:
    """The training state that moves with the job through membership changes, in-process.

    Give it what a newcomer must receive from a running worker: ``model`` (a module),
    ``optimizer`` and ``step`` (the number of completed steps), plus any values (numbers,
    strings, lists, dicts, tensors) as keywords, read back from :attr:`values`. Create it after
    ``rdzv.torch.init_process_group()`` and the set-up (building and sharding the model, making
    the optimizer), before anything that uses the job's process group (DDP): on a newcomer the
    constructor joins the running group (a newcomer node's workers set up in a provisional group
    of their own until then) and receives the state from a running worker.

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
        shards = _shards_of(model, optimizer)
        if provisional():  # a newcomer set up in its node's own group: warm up, then join
            if shards is not None:
                shards.prepare()
            join_running_group(str(dist.get_backend()))
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
        self._last: float | None = None
        self._step_time: float | None = None
        self._reported = 0.0
        self._aborts = group_sockets.aborts
        """The aborts counted when this worker took its current group's plan: one more means
        the agent aborted the group, and any error of the worker is the group failing."""
        self._entering: int | None = None
        """The round of the group being entered at a step boundary (None: none)."""
        self._synced = False
        """Whether the workers of the current group are known to hold one state."""
        self._created = self._agreed = 0.0
        """When the group being entered was created, and its state agreed (perf_counter)."""
        self._shards = shards
        """The model's shards and replicas, for a model sharded over ``node_mesh()``."""
        self._link: AgentLink | None = agent_link()
        if self._link is None:
            self._synced = True  # torchrun: the program restores one state everywhere
            if self._shards is not None:
                self._shards.enter()
            return
        self._timer = StepTimer(model, optimizer)
        self._link.where = self._where
        if self._shards is not None:
            self._link.send(Shards())  # a crash restarts the node's workers together
            self._shards.held = self._held
        joined = joined_plan()
        if joined is None:
            self._link.send(Progress(self.step))
            return
        plan, self._aborts = joined
        started = time.perf_counter()  # a newcomer: it takes the state of the group it joined
        while True:
            try:
                self.received = self._agree(plan.source, fresh=True)
                break
            except Exception as exc:
                if not self._group_failure(exc):
                    raise
                self._broken(plan.round, exc, fresh=True)
                taken = self._enter_next(fresh=True)
                if taken is None:
                    return
                plan, self._aborts = taken
        self._entered(plan, started, self.received, callbacks=False)

    # -- the loop ---------------------------------------------------------------------------
    def on_change(self, callback: Callable[["ElasticState"], None]) -> Callable[..., None]:
        """Run ``callback(state)`` after each switch to a new group (usable as a decorator)."""
        self._callbacks.append(callback)
        return callback

    def steps(self, total: int) -> Iterator[int]:
        """The step numbers from :attr:`step` to ``total`` (exclusive), switching between steps
        when the job changes; ends early if this node leaves the job. Under ``rdzv run`` the
        workers first agree on one state (:meth:`sync`)."""
        self.sync()
        while self.step < total and not self.left:
            yield self.step
            self.step_done()
        self._outside()

    def sync(self) -> None:
        """Bring the workers of a group just started (or restarted) to one state, once, after
        each restored its own (a checkpoint; an older one on some node, a fresh initialisation
        where there is none): the most advanced state is sent to every worker that holds
        another. A collective of every worker of the group: :meth:`steps` calls it, a loop that
        calls :meth:`step_done` itself calls it before its first step. Without ``rdzv run``, or
        once the group agreed, it does nothing."""
        if self._link is None or self._synced:
            return
        before = self.step
        if self._agree(None, fresh=False):
            self.received = True
            logger.warning("this worker started from another state than its group's most "
                           "advanced one (step %d): it received that one (step %d) before its "
                           "first step", before, self.step)
        self._synced = True

    def step_done(self) -> None:
        """Count a completed step; at the planned step, move to the new group (or leave).

        Costs a clock read and an attribute check unless a move is due (see
        ``bench/membership.py``); every ``PROGRESS_EVERY`` seconds a progress report to the
        agent."""
        if not self._synced:  # a loop that did not call sync() first agrees after a step
            self.sync()
        self.step += 1
        now = time.perf_counter()
        if self._last is not None:
            self._step_time = mean_step(self._step_time, now - self._last)
        link = self._link
        if link is None:
            self._last = now
            return
        self._timer.step(self._last, now)
        self._last = now
        link.beat(self._step_time)
        if now - self._reported >= PROGRESS_EVERY:
            self._reported = now
            link.send(Progress(self.step, self._step_time, *self._timer.take()))
        agreed = self._shards.agreement() if self._shards is not None else None
        plan = link.peek()
        if plan is not None and due(plan, self.step, agreed):
            taken = link.take(plan)
            if taken is not None:  # (an abort may have dropped it since, or a newer replaced it)
                self._move(*taken)

    def reduce_gradients(self) -> None:
        """For a model sharded over ``node_mesh()``: average the gradients over the nodes now
        (before clipping them, say), not in the optimizer's step as by default. Nothing for a
        model that is not sharded (DDP reduces in backward)."""
        if self._shards is not None:
            self._shards.reduce()

    def run(self, train: Callable[[], T]) -> T | None:
        """Call ``train()`` (the training loop) and return what it returns; when a member of the
        group is lost while it runs, recover in-process and call it again (None: this node left
        the job while its group was broken).

        ``train`` resumes from :attr:`step`: write the loop as ``for step in
        state.steps(total)``. Put every collective of a step before ``optimizer.step()`` (DDP's
        backward, a logged loss' all_reduce): then a failed step was applied on no worker or,
        complete, on some, and the survivors go on from the most advanced one. An error that is
        not a group failure, or a recovery the agents give up, is raised as it is.
        """
        while True:
            try:
                result = train()
                self._outside()
                return result
            except Exception as exc:
                if self._link is None or not self._group_failure(exc):
                    raise
                if not self._recover(exc):
                    return None

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        """Work between training steps that may take long (an evaluation, a large checkpoint):
        its agent does not take the worker for hung meanwhile (``--hang-timeout``), and the time
        counts as no step's."""
        self._outside()
        try:
            yield
        finally:
            self._last = time.perf_counter()  # the next step starts now

    def _outside(self) -> None:
        """Tell the agent this worker is not in a training step (a progress report without a
        step time: its hang watch waits for the next one)."""
        if self._link is not None:
            self._link.send(Progress(self.step))

    def _held(self) -> int:
        """The round of the switch planned for this worker and not taken yet (-1: none), for
        its node's commit."""
        plan = self._link.peek() if self._link is not None else None
        return plan.round if plan is not None and plan.kind is PlanKind.SWITCH else -1

    def _where(self, aborted_at: float) -> Where:
        waiting, frame = self._timer.waiting(self._last or 0.0)
        blocked = aborted_at > 0 and self._timer.stuck(self._last or 0.0, aborted_at)
        return Where(self.step, waiting, frame, blocked)

    @property
    def step_time(self) -> float | None:
        """Recent seconds per step (a moving average), None before two steps."""
        return self._step_time

    # -- moving to a new group ---------------------------------------------------------------
    def _move(self, plan: Plan, aborts: int) -> None:
        """At a step boundary: act on the agent's plan (on the training thread)."""
        assert self._link is not None
        self._aborts = aborts
        group_sockets.close_current()  # a peer that took the plan late must not wait on us
        if plan.kind is PlanKind.RECOVER and self._shards is not None:
            self._shards.abandon()  # a local peer may wait in the next step already
        if plan.kind is PlanKind.LEAVE:
            leave_group()
            self.left = True
            self._link.send(Left(self.step))
            return
        started = time.perf_counter()
        self._entering = plan.round
        leave_group()
        enter_group(self._backend, plan, aborts)
        self._created = time.perf_counter()
        self._entered(plan, started, self._agree(plan.source, fresh=False))

    def _recover(self, exc: BaseException) -> bool:
        """The group failed under this worker: report it, then enter the group its agent plans
        (False: its node leaves instead)."""
        assert self._link is not None
        started = time.perf_counter()
        if isinstance(exc, ValueError) and "world group map" in str(exc) and exc.__context__:
            # torch's logging of a failed collective on a group outside its map of the job's
            # groups (the node group) fails in turn, and hides the failure: report that one
            exc = exc.__context__
        logger.warning("the process group failed at step %d (%s: %s); waiting for the agents",
                       self.step, type(exc).__name__, first_line(exc))
        self._broken(self._entering, exc)
        group_sockets.abort()
        leave_group()
        while True:
            taken = self._enter_next(fresh=False)
            if taken is None:
                return False
            plan, self._aborts = taken
            self._entering = plan.round
            try:
                self._entered(plan, started, self._agree(plan.source, fresh=False))
            except Exception as error:
                if not self._group_failure(error):
                    raise
                self._broken(plan.round, error)
                continue
            self.recoveries += 1
            return True

    def _enter_next(self, fresh: bool) -> tuple[Plan, int] | None:
        """Wait for the next plan naming a group and enter it: (the plan, the aborts counted
        when it was taken), None if its node leaves; a group that fails to form is reported and
        the next plan awaited."""
        assert self._link is not None
        while True:
            plan, aborts = self._link.wait()
            if plan.kind is PlanKind.LEAVE:
                self.left = True
                self._link.send(Left(self.step))
                return None
            try:
                leave_group()
                enter_group(self._backend, plan, aborts)
                self._created = time.perf_counter()
                return plan, aborts
            except GroupLost as exc:
                self._broken(plan.round, exc, fresh=fresh)

    def _broken(self, round_: int | None, exc: BaseException, fresh: bool = False) -> None:
        """Tell the agent this worker's group failed (in round ``round_``'s entry, or None: in
        a step). A sharded model's node group is cut first: a local peer that completed the
        step or the entry may wait for this worker in the node group already."""
        assert self._link is not None
        if self._shards is not None:
            self._shards.abandon()
        self._link.send(Broken(self.step, fresh=fresh, round=round_, error=first_line(exc)))

    def _agree(self, decided: int | None, fresh: bool) -> bool:
        """Bring every worker of the current group to one state (``reach_one_state``), from the
        ``decided`` source if it holds the most advanced one; whether this worker received it."""
        try:
            if self._shards is not None:
                self._shards.enter()
            reached = reach_one_state(self.step, fresh, decided, tree=self._tree, load=self._load,
                                      shards=self._shards.node.size if self._shards else 1,
                                      device=self._device())
        except StateMismatch as exc:
            assert self._link is not None
            self._link.send(Failed(exc.report, exc.misfit))
            raise SwitchError(str(exc)) from exc
        self._agreed = reached.agreed
        return reached.received

    def _entered(self, plan: Plan, started: float, received: bool,
                 callbacks: bool = True) -> None:
        """The worker holds the group's state: run the callbacks (a group failure in them is
        one of the transition, ``_entering`` still set) and tell the agent."""
        assert self._link is not None
        self.rank, self.world_size = plan.rank, plan.world_size
        if callbacks:
            for callback in self._callbacks:
                callback(self)
        self._entering = None
        self._synced = True
        if plan.kind is PlanKind.SWITCH:
            self.switches += 1
        self._last = time.perf_counter()  # the pause is not a step
        created = max(started, min(self._created, self._last))
        agreed = max(created, min(self._agreed, self._last))
        self._link.send(Entered(plan.round, (self._last - started) * 1000, self.step, received,
                                (created - started) * 1000, (agreed - created) * 1000))

    def _group_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the group failing under this worker (not a bug of its own): it,
        or an error it was raised while handling (torch's error reports can fail in turn)."""
        if group_sockets.aborts != self._aborts:
            return True
        seen: BaseException | None = exc
        for _ in range(8):
            if seen is None:
                return False
            if isinstance(seen, (GroupLost, dist.DistError)) or (isinstance(
                    seen, RuntimeError) and any(w in str(seen) for w in PEER_FAILURE_WORDS)):
                return True
            seen = seen.__cause__ or seen.__context__
        return False

    # -- the state ----------------------------------------------------------------------------
    def _tree(self) -> dict[str, Any]:
        if self._shards is not None:
            return {"step": self.step, "values": self.values, **self._shards.tree()}
        return {"step": self.step, "values": self.values,
                "model": dict(self.model.state_dict()) if self.model is not None else None,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}

    def _load(self, tree: Any) -> int:
        """Take the state received from a peer; its step."""
        try:
            if self._shards is not None:
                self._shards.apply(tree)
            elif self.model is not None:
                self.model.load_state_dict(tree["model"])
            if self.optimizer is not None and self._shards is None:
                self.optimizer.load_state_dict(tree["optimizer"])
            self.step = int(tree["step"])
            self.values.clear()
            self.values.update(tree["values"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise StateMismatch(f"the state received from a peer does not fit this worker's "
                                f"model and optimizer (is every node running the same "
                                f"program?): {exc}", f"the state received does not fit: {exc}",
                                misfit=not isinstance(exc, torch.cuda.OutOfMemoryError)) from exc
        return self.step

    def _device(self) -> torch.device:
        if self._backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

