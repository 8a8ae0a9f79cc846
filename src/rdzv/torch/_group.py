"""A worker's side of in-process changes, below :class:`ElasticState`: its connection to its
agent (the plans it receives, aborts, its SIGTERM notice), and creating a process group under a
round's own store prefix.

The plans of the agent (``rdzv._messages.Plan``) arrive on the channel's thread and wait here
for the training thread, which takes the newest one when it can act on it: at a step boundary,
when its group failed, or (a worker started to join) in ``ElasticState`` (after setting up in
its node's provisional group) or, started alone, in ``init_process_group``. An ``Abort``
drops a plan not yet taken (its round was abandoned) and shuts down the sockets of every group
of the process, also one being created, so whatever waits on a lost peer fails at once.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import IO, Any, Callable

import torch.distributed as dist

from .._channel import (
    ENV_CHANNEL,
    ENV_JOIN,
    ENV_JOIN_STORE,
    STACKS_SIGNAL,
    ChannelClient,
    stacks_file,
)
from .._messages import (
    Abort,
    Broken,
    Closed,
    Left,
    Moving,
    Plan,
    PlanKind,
    Probe,
    Stop,
    Term,
    Where,
)
from ..errors import RendezvousError, RendezvousParameterError
from ._abort import GroupSockets
from ._steptime import describe, in_collective, stuck

logger = logging.getLogger(__name__)

LISTEN_POLL = 0.002
"""Seconds between a worker's attempts to reach the new group's store before it listens."""
STORE_TIMEOUT = timedelta(minutes=5)
"""How long a new group's store waits for its members (an abort ends it sooner)."""
WAIT_SLICE = 1.0
"""Seconds between checks that the agent is still there, while a worker waits for a plan."""
ABORT_GRACE = 3.0
"""Seconds (at least; three steps if steps are slower) an aborted group's pending collective
has to fail before the worker ends itself (see :meth:`AgentLink.beat`). Not less: on a loaded
machine a training thread woken by the abort took over a second to leave a backward pass, and
ending it costs a restart of the worker (seconds of start-up), more than the wait."""

group_sockets = GroupSockets()
"""The sockets of this process's groups (to abort them when a peer is lost)."""
group_options: dict[str, Any] = {"timeout": timedelta(minutes=10), "kwargs": {}}
"""How ``init_process_group`` was called (timeout, other keywords such as ``device_id``): every
group this worker creates in-process is made the same way."""
entering_hooks: list[Callable[[], None]] = []
"""Called in every group this worker enters, once it is created: the node's own group checks the
new group's layout and registers its name again (``_nodegroup``)."""


class SwitchError(RendezvousError):
    """This worker could not move to the new process group; its agent restarts the workers."""


class GroupLost(RendezvousError):
    """The group this worker is in, or is entering, failed (a peer is gone, or the agent aborted
    it): the worker reports it and waits for its agent's next plan."""


class AgentLink:
    """This worker's connection to its agent: the plans it sent, whether it aborted, and the
    progress reports; one per process (:func:`agent_link`).

    Shutting an aborted gloo group's sockets down fails its pending collective, but not always:
    a ring step waiting for its send to complete (``UnboundBuffer::waitSend``) can wait for the
    group's timeout (10 minutes by default) on a socket already closed; and a group the abort
    does not reach (the node's own group of a sharded model, ``_nodegroup``) is freed only once
    the local peer it waits for goes to recover (and cuts it). So after an abort the training
    thread must show within the grace that it has left the aborted group (it took a plan, or
    waits for one, having reported the failure); a step boundary alone does not, as the next
    step may wait again. If it does not, the worker ends itself with SIGKILL, and its agent
    restarts it (alone, or with its node's workers for a sharded model), as a crashed worker:
    it rejoins from its peers, who recover in-process without it meanwhile.
    """

    def __init__(self, path: str, fresh: bool) -> None:
        self.fresh = fresh
        self._cond = threading.Condition()
        self._plan: Plan | None = None
        self._gone = False
        self._moves = 0
        """Plans taken: one more after an abort shows the training thread left the group."""
        self._waiting = False
        self._step_time = 0.0
        self._stopping = False
        self._noticed = False
        self._term = threading.Event()
        self.where: Callable[[float], Where] = self._where_unknown
        """Where the training thread is, and whether it is stuck since the abort at the given
        ``perf_counter`` time (0: none yet); :class:`ElasticState` sets a better one."""
        self._aborted_at = 0.0
        self._main = threading.get_ident()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._stacks = _dump_stacks_on_signal(stacks_file(path, local_rank))
        self.client = ChannelClient(path, local_rank, self._on, fresh)
        group_sockets.exclude(self.client.sock)
        self._watch_sigterm()

    def _where_unknown(self, aborted_at: float) -> Where:
        frame = sys._current_frames().get(self._main)
        blocked = aborted_at > 0 and stuck(self._main, False, frame)
        return Where(-1, in_collective(frame), describe(frame), blocked)

    # -- the agent's messages (channel thread) ------------------------------------------------
    def _on(self, message: Any) -> None:
        if isinstance(message, Plan):
            with self._cond:
                self._plan = message
                self._cond.notify_all()
        elif isinstance(message, Abort):
            self._aborted_at = time.perf_counter()
            with self._cond:
                self._plan = None  # a plan not taken yet belongs to an abandoned round
                self._cond.notify_all()
            moves = self._moves
            aborted = group_sockets.abort()
            if aborted:
                logger.warning("the agent aborted the process group (a member is lost): %d "
                               "socket(s) shut down", aborted)
                self._watch_abort(moves)
        elif isinstance(message, Stop):
            self._on_stop()
        elif isinstance(message, Probe):
            self.send(self.where(self._aborted_at))
        elif isinstance(message, Closed):
            if self._noticed:  # told to leave by SIGTERM, and its agent has ended: end as the
                self._on_stop()  # signal's default action would (scancel of a whole job)
            with self._cond:
                self._gone = True
                self._cond.notify_all()

    def send(self, message: Any) -> None:
        self.client.send(message)

    # -- aborts that do not wake the training thread --------------------------------------------
    def beat(self, step_time: float | None = None) -> None:
        """A step ended (in ``step_time`` seconds, a recent mean): the grace of an abort is
        three of them (at least ``ABORT_GRACE``)."""
        if step_time is not None:
            self._step_time = step_time

    def _watch_abort(self, moves: int) -> None:
        grace = max(ABORT_GRACE, 3 * self._step_time)
        threading.Thread(target=self._end_if_stuck, args=(moves, grace), daemon=True,
                         name="rdzv-abort-watch").start()

    def _end_if_stuck(self, moves: int, grace: float) -> None:
        if not self._still_stuck(moves, grace):
            return
        cut = group_sockets.cut_creations()
        if cut:
            logger.warning("the group being created still waits %.1f s after the abort, on %d "
                           "socket(s) it opened since: shutting them down too", grace, cut)
            if not self._still_stuck(moves, grace):
                return
        logger.error("the aborted process group's collective still waits %.1f s after the "
                     "abort (gloo may wait on a closed peer until the group's timeout): this "
                     "worker ends itself; its agent restarts it alone and it rejoins from its "
                     "peers", 2 * grace if cut else grace)
        sys.stdout.flush()
        faulthandler.dump_traceback(sys.stderr, all_threads=True)  # where it waits
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _still_stuck(self, moves: int, grace: float) -> bool:
        """Whether the training thread neither took a plan nor waits for one (it is still in
        the aborted group's collective, or creating one) ``grace`` seconds from now."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self._moves != moves or self._waiting:
                return False
            time.sleep(0.02)
        return True

    # -- plans (training thread) --------------------------------------------------------------
    def peek(self) -> Plan | None:
        """The newest plan not taken yet."""
        return self._plan

    def take(self, seen: Plan) -> tuple[Plan, int] | None:
        """Take ``seen``, the plan :meth:`peek` gave, with the abort count it was taken at
        (None: an abort dropped it since, or a newer plan replaced it, which is left for the
        next step boundary to weigh)."""
        with self._cond:
            if self._plan is not seen:
                return None
            self._plan = None
            self._moves += 1
            taken = seen, group_sockets.aborts
        self.send(Moving(seen.round))
        return taken

    def wait(self) -> tuple[Plan, int]:
        """Wait for the next plan (with the aborts counted when it was taken); SwitchError if
        the agent is gone. No deadline of its own: the agent bounds every transition and stops
        its workers when one fails."""
        with self._cond:
            self._waiting = True  # (out of every collective)
            try:
                while True:
                    plan = self._plan
                    if plan is not None:
                        self._plan = None
                        self._moves += 1
                        taken = plan, group_sockets.aborts
                        break
                    if self._gone:
                        # Told to leave by a SIGTERM whose handler ran only once a collective
                        # returned (a handler runs between two lines of Python), after the
                        # agent's end was seen; or stopped by its agent, which hung up before
                        # its SIGTERM came: end as that signal would.
                        if self._noticed or self._stopping:
                            self._exit_as_sigterm()
                        raise SwitchError("this worker's rdzv agent is gone")
                    self._cond.wait(WAIT_SLICE)
            finally:
                self._waiting = False
        self.send(Moving(taken[0].round))
        return taken

    # -- stopping and SIGTERM ------------------------------------------------------------------
    def _watch_sigterm(self) -> None:
        """Under ``rdzv run`` a SIGTERM (Slurm and many runtimes signal every process of a node
        at once) is the node's notice to leave: the worker tells its agent and trains on until
        the others have moved on. A program that set its own SIGTERM handler keeps it."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        # The notice is sent from a thread of its own, started now: the handler runs on the
        # training thread, which may hold the channel's send lock when the signal comes.
        threading.Thread(target=self._send_term, name="rdzv-sigterm", daemon=True).start()
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _send_term(self) -> None:
        self._term.wait()
        self.send(Term())

    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        if self._stopping or self._noticed:  # the agent stops this worker, or a second one
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._noticed = True
        self._term.set()

    def _on_stop(self) -> None:
        """The agent stops its workers: its SIGTERM follows (or came first, taken for a
        notice): end now, as SIGTERM's default action would."""
        self._stopping = True
        if self._noticed:
            self._exit_as_sigterm()

    @staticmethod
    def _exit_as_sigterm() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)


def _dump_stacks_on_signal(path: str) -> IO[str] | None:
    """Have Python write every thread's stack to ``path`` on :data:`STACKS_SIGNAL` (unless the
    program handles that signal itself); the open file, kept while the process lives."""
    if signal.getsignal(STACKS_SIGNAL) not in (signal.SIG_DFL, None):
        return None
    try:
        # append: the agent empties the file before each dump, and a write must then start at
        # its (new) end, not at this process's old offset
        handle = open(path, "a")  # noqa: SIM115 (faulthandler writes to it until the exit)
    except OSError as exc:
        logger.warning("cannot prepare the stack dump file %s: %s", path, exc)
        return None
    faulthandler.register(STACKS_SIGNAL, file=handle, all_threads=True)
    return handle


_link: AgentLink | None = None
_joined: tuple[Plan, int] | None = None
_provisional = False
"""Whether the default group is the provisional one of a node whose workers all join."""


def start_provisional(backend: str, local_rank: int, size: int) -> None:
    """Every worker of this node starts to join a running group (``RDZV_JOIN_STORE``): make
    the node's workers a provisional default group of their own (ranks = local ranks), through
    the file the agent named. They set up in it (shard the model over :func:`node_mesh`, warm
    up) while the running workers train; :class:`ElasticState` then joins the job's group."""
    global _provisional
    store = dist.FileStore(os.environ[ENV_JOIN_STORE], size)
    dist.init_process_group(backend, store=store, rank=local_rank, world_size=size,
                            timeout=group_options["timeout"], **group_options["kwargs"])
    _provisional = True


def provisional() -> bool:
    """Whether this worker is set up in its node's provisional group and has yet to join."""
    return _provisional


def joined_plan() -> tuple[Plan, int] | None:
    """The plan of the group this worker joined when it started, and the aborts counted when
    it took it (None: it started with the group, or under torchrun): :class:`ElasticState`
    then takes the group's state."""
    return _joined


def join_running_group(backend: str) -> tuple[int, int]:
    """A worker started to join a running group (``RDZV_INPROCESS_JOIN``): tell the agent it is
    up (warm), wait for its plan and enter the group it names (leaving its provisional group);
    a group that fails to form is reported and the next plan awaited. Returns (rank, world
    size)."""
    global _joined, _provisional
    if _provisional:  # the node's joiners connect together: one is not brought in alone
        dist.barrier()
    link = agent_link(fresh=True)
    if link is None:
        raise RendezvousParameterError(
            f"{ENV_JOIN} is set but {ENV_CHANNEL} is not: both come from `rdzv run`; do not "
            "set them by hand")
    while True:
        plan, aborts = link.wait()
        if plan.kind is PlanKind.LEAVE:  # its node leaves before it ever joined
            link.send(Left(0))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            leave_group()  # (the provisional one, if any)
            _provisional = False
            enter_group(backend, plan, aborts)
        except GroupLost as exc:
            link.send(Broken(0, fresh=True, round=plan.round, error=first_line(exc)))
            continue
        _joined = plan, aborts
        return plan.rank, plan.world_size


def agent_link(fresh: bool = False) -> AgentLink | None:
    """The connection to this worker's rdzv agent (None when not started by ``rdzv run``)."""
    global _link
    path = os.environ.get(ENV_CHANNEL)
    if _link is None and path:
        _link = AgentLink(path, fresh)
    return _link


def group_store(addr: str, port: int, rank: int, world_size: int, aborts: int) -> dist.Store:
    """The TCPStore of a group created in-process (its global rank 0 serves it; the others
    wait for it to listen first, since torch's client backs off for about 0.4 s when its first
    connection is refused)."""
    if rank != 0:
        _wait_listening(addr, port, STORE_TIMEOUT.total_seconds(), aborts)
    return dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=STORE_TIMEOUT,
                         wait_for_workers=False)


def _wait_listening(addr: str, port: int, timeout: float, aborts: int) -> None:
    """Return once ``addr:port`` accepts connections (or after ``timeout``: torch's client then
    reports the failure in its own words); GroupLost if an abort comes meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if group_sockets.aborts != aborts:
            raise GroupLost("the agent aborted the group while its store was awaited")
        try:
            socket.create_connection((addr, port), timeout=min(1.0, timeout)).close()
            return
        except OSError:
            time.sleep(LISTEN_POLL)


def enter_group(backend: str, plan: Plan, aborts: int) -> None:
    """Create (join) the process group of ``plan`` as the default group, the way the worker's
    first one was made (``group_options``). GroupLost if it fails or an abort came since the
    plan was taken (``aborts``): the group's round was abandoned."""
    if plan.kind not in (PlanKind.SWITCH, PlanKind.RECOVER):
        raise SwitchError(f"a {plan.kind.value!r} plan names no group to enter")
    try:
        with group_sockets.recording():
            if group_sockets.aborts != aborts:
                raise GroupLost("the agent aborted the group before it was created")
            store = group_store(plan.master_addr, plan.master_port, plan.rank, plan.world_size,
                                aborts)
            dist.init_process_group(backend, store=dist.PrefixStore(f"{plan.prefix}/", store),
                                    rank=plan.rank, world_size=plan.world_size,
                                    timeout=group_options["timeout"], **group_options["kwargs"])
        for hook in entering_hooks:  # (what they make is not the job group's: not recorded)
            hook()
    except (GroupLost, SwitchError):
        raise
    except Exception as exc:  # torch raises RuntimeError, DistError, DistNetworkError, ...
        leave_group()
        raise GroupLost(f"cannot create the group of round {plan.round}: "
                        f"{type(exc).__name__}: {first_line(exc)}") from exc
    os.environ.update({name: str(getattr(plan, key)) for name, key in PLAN_ENV.items()})


PLAN_ENV = {"RANK": "rank", "WORLD_SIZE": "world_size", "GROUP_RANK": "group_rank",
            "GROUP_WORLD_SIZE": "group_world_size", "ROLE_RANK": "role_rank",
            "ROLE_WORLD_SIZE": "role_world_size", "MASTER_ADDR": "master_addr",
            "MASTER_PORT": "master_port"}
"""The variables ``rdzv run`` gives a worker, updated from the plan of each group it enters."""


def leave_group() -> None:
    """Destroy the default group if there is one (a broken group may not tear down cleanly)."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a failed group's teardown can fail too: it is gone either way
        logger.warning("destroying the process group: %s", first_line(exc))
    group_sockets.forget_closed()


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, at most 300 characters (for a report)."""
    return (str(exc).strip().splitlines() or [""])[0][:300]
