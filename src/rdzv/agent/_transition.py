"""A planned membership change, carried out on a thread while the workers keep training.

The rules are in ``_changes.py``; this module does the I/O. Every node of the new round runs one
of two paths and ends with one :class:`TransitionDone` event on the agent's queue:

* a **member** of the running round (:func:`member_transition`) joins the next round in the
  background, exchanges worker counts (``assign``), learns from group rank 0 how the round
  starts (``MODE_KEY``), and for an in-process switch sends its workers their ``plan``, says it
  is ready, gets the switch step and waits for its workers to switch;
* a **newcomer** (:func:`newcomer_transition`) has started its workers with ``RDZV_INPROCESS_JOIN``
  (they import torch and connect to their agent: they are warm), says it is ready, and waits
  for its workers to be taken into the group.

Group rank 0 of the new round (a member of the old one) coordinates: once every node is ready it
asks its first worker for its step and step time, picks the switch step and writes it
(``SWITCH_KEY``) into the old round's store, where the members and a leaving node read it, and
into the new one's (``JOIN_KEY``), where newcomers read it. If a node is not ready in time it writes a restart
instead, and every node restarts its workers in the new round. A node that leaves
(:func:`wait_for_switch`) reads the same key to know when the others have moved on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..errors import RendezvousError
from ..rendezvous import RendezvousHandler, RendezvousInfo
from ..store import Store
from ._changes import Mode, choose_mode, recovery_plan, switch_step
from .._channel import ChannelServer
from ._round import (
    CAPABLE_DIR,
    JOIN_KEY,
    MODE_KEY,
    READY_DIR,
    SWITCH_KEY,
    Assignment,
    assign,
    loads_entry,
)

logger = logging.getLogger(__name__)

ASSIGN_TIMEOUT = 60.0
"""Seconds a node waits for the other nodes of a formed round to exchange their worker counts."""
LEAD_SECONDS = 0.25
"""How long the switch step is announced ahead of time, at least (see ``switch_step``)."""
QUERY_TIMEOUT = 5.0
"""Seconds the coordinator waits for its worker to report its step."""
PROGRESS_INTERVAL = 10.0
"""Seconds between 'still waiting' lines while the survivors of a loss wait for nodes."""
WAIT_SLICE = 0.25
"""Longest single blocking store call here: the agent's other threads share the client."""


@dataclass(frozen=True)
class WorkersConnected:
    """Event: every worker of group ``generation`` connected to the agent (in-process capable)."""

    generation: int


@dataclass(frozen=True)
class WorkersBroken:
    """Event: a worker of group ``generation`` reports that a collective failed (a peer is gone)."""

    generation: int


@dataclass(frozen=True)
class TransitionDone:
    """Event: a transition ended. ``mode`` IN_PROCESS means the workers run in the new round."""

    generation: int
    info: RendezvousInfo | None = None
    assignment: Assignment | None = None
    mode: Mode = Mode.RESTART
    reason: str = ""
    error: RendezvousError | None = None
    formed_ms: float | None = None
    pause_ms: float | None = None
    switch_step: int | None = None
    recovery: bool = False
    """The transition followed the loss of a member (not a planned change)."""


class WorkerLink:
    """The agent's view of its workers through the channel: what each last said, by ``op``."""

    def __init__(self, events: Any) -> None:
        self._events = events
        self._cond = threading.Condition()
        self._said: dict[int, dict[str, dict[str, Any]]] = {}
        self._nproc = 0
        self._generation = 0
        self.server = ChannelServer(self._on_message)

    @property
    def path(self) -> str:
        return self.server.path

    def reset(self, nproc: int, generation: int) -> None:
        """New workers were started (or are about to be): forget what the old ones said."""
        self.server.forget()
        with self._cond:
            self._said, self._nproc, self._generation = {}, nproc, generation

    def retag(self, generation: int) -> None:
        """The same workers run on in the round of ``generation``."""
        with self._cond:
            self._generation = generation

    def _on_message(self, local_rank: int, message: dict[str, Any]) -> None:
        with self._cond:
            self._said.setdefault(local_rank, {})[message["op"]] = message
            self._cond.notify_all()
            connected = message["op"] == "hello" and self._all("hello")
            generation = self._generation
        if connected:
            self._events.put(WorkersConnected(generation))
        if message["op"] == "broken":
            self._events.put(WorkersBroken(generation))

    def _all(self, op: str) -> bool:
        return self._nproc > 0 and all(op in self._said.get(lr, {}) for lr in range(self._nproc))

    def connected(self) -> bool:
        with self._cond:
            return self._all("hello") and not self._any({"closed"})

    def _any(self, ops: set[str]) -> bool:
        return any(ops & said.keys() for said in self._said.values())

    def disconnect(self) -> None:
        """The workers were stopped: drop their connections."""
        self.server.forget()

    def forget(self, *ops: str) -> None:
        with self._cond:
            for said in self._said.values():
                for op in ops:
                    said.pop(op, None)

    def said(self, local_rank: int, op: str) -> dict[str, Any] | None:
        with self._cond:
            return self._said.get(local_rank, {}).get(op)

    def wait_one(self, local_rank: int, op: str, timeout: float) -> dict[str, Any] | None:
        """What worker ``local_rank`` says next as ``op`` (None after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while op not in self._said.get(local_rank, {}):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._said[local_rank][op]

    def wait_all(self, op: str, timeout: float, fail: set[str]) -> str | None:
        """Wait until every worker said ``op``: None, or the first ``fail`` op one of them said
        instead (or ``"timeout"``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for said in self._said.values():
                    for bad in fail & said.keys():
                        return bad
                if self._all(op):
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                self._cond.wait(remaining)

    def send(self, local_rank: int, message: dict[str, Any]) -> bool:
        return self.server.send(local_rank, message)

    def send_all(self, make: Callable[[int], dict[str, Any]]) -> bool:
        with self._cond:
            nproc = self._nproc
        return all([self.server.send(lr, make(lr)) for lr in range(nproc)])

    def close(self) -> None:
        self.server.close()


@dataclass(frozen=True)
class SwitchContext:
    """What a transition needs of its agent."""

    handler: RendezvousHandler
    link: WorkerLink
    nproc: int
    role: str
    host: str
    max_nodes: int
    switch_timeout: float
    restart_on_change: bool
    say: Callable[[str], None]


def start_on_thread(work: Callable[[], TransitionDone], events: Any, name: str,
                    generation: int) -> None:
    """Run ``work`` on a daemon thread and put its TransitionDone on ``events`` (also when it
    fails unexpectedly: the agent must hear the end of every transition)."""

    def run() -> None:
        try:
            done = work()
        except Exception as exc:  # malformed agent JSON, a bug: end the transition all the same
            logger.exception("the transition to the next round failed")
            done = TransitionDone(generation, error=RendezvousError(
                f"the transition failed: {type(exc).__name__}: {exc}"))
        events.put(done)

    threading.Thread(target=run, daemon=True, name=name).start()


def wait_key(store: Store, key: str, timeout: float) -> bytes | None:
    """The value of ``key`` once it is set, waiting at most ``timeout`` s (None then), in slices
    so that the agent's other threads are not held behind this one on a shared client."""
    deadline = time.monotonic() + timeout
    while True:
        value = store.try_get(key)
        if value is not None:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        since = store.revision(key)
        if store.try_get(key) is None:
            store.watch(key, since, min(WAIT_SLICE, remaining))


def start_round(ctx: SwitchContext, info: RendezvousInfo, assignment: Assignment,
                old: RendezvousInfo | None) -> dict[str, Any]:
    """How round ``info`` starts: group rank 0 decides and publishes it, the others read it.

    ``old``: the round this node's workers are running in (None: they are not running).
    """
    store = info.store
    if assignment.group_rank != 0:
        raw = wait_key(store, MODE_KEY, ASSIGN_TIMEOUT)
        if raw is None:
            raise RendezvousError(f"group rank 0 did not say within {ASSIGN_TIMEOUT:g} s how "
                                  "the new round starts")
        return loads_entry(MODE_KEY, raw)
    capable = old.store.count_keys(CAPABLE_DIR) if old is not None else 0
    mode = choose_mode(ctx.restart_on_change, old is not None, capable,
                       old.world_size if old is not None else 0)
    plan = {"mode": mode.value, "prefix": f"rdzv-{uuid.uuid4().hex[:12]}"}
    store.set(MODE_KEY, json.dumps(plan))
    if mode is Mode.RESTART and old is not None:
        why = ("--restart-on-change" if ctx.restart_on_change else
               "not every node's workers use the in-process API")
        announce(old, info, {"restart": True, "why": why})
    return plan


def _why(old: RendezvousInfo) -> str:
    """Group rank 0's reason for restarting the workers, as written in the old round."""
    raw = old.store.try_get(SWITCH_KEY)
    return "" if raw is None else str(loads_entry(SWITCH_KEY, raw).get("why", ""))


def announce(old: RendezvousInfo, new: RendezvousInfo, decision: dict[str, Any]) -> None:
    """Write the switch decision where members, a leaving node and newcomers read it."""
    raw = json.dumps(decision)
    old.store.set(SWITCH_KEY, raw)
    new.store.set(JOIN_KEY, raw)


def worker_plan(assignment: Assignment, local_rank: int, prefix: str) -> dict[str, Any]:
    """What a worker needs to join the new group."""
    return {"op": "plan", "rank": assignment.rank_offset + local_rank,
            "world_size": assignment.world_size, "group_rank": assignment.group_rank,
            "group_world_size": assignment.group_world_size,
            "role_rank": assignment.role_rank_offset + local_rank,
            "role_world_size": assignment.role_world_size,
            "master_addr": assignment.master_addr, "master_port": assignment.master_port,
            "prefix": prefix, "leave": False}


def _join_next(ctx: SwitchContext, old: RendezvousInfo, generation: int,
               recovery: bool) -> tuple[TransitionDone, dict[str, Any] | None]:
    """Join the round after ``old`` and learn how it starts: (done, plan), where plan is None
    when ``done`` is already the end (an error, or group rank 0 restarts the workers)."""
    started = time.monotonic()
    try:
        info = _next_round(ctx, started)
    except RendezvousError as exc:
        return TransitionDone(generation, error=exc, recovery=recovery), None
    formed_ms = (time.monotonic() - started) * 1000
    try:
        assignment = assign(info, ctx.handler, ctx.nproc, ctx.role, ctx.host, ASSIGN_TIMEOUT,
                            formed_ms / 1000, ctx.max_nodes)
        plan = start_round(ctx, info, assignment, old)
    except RendezvousError as exc:
        return TransitionDone(generation, info, error=exc, formed_ms=formed_ms,
                              recovery=recovery), None
    done = TransitionDone(generation, info, assignment, formed_ms=formed_ms, recovery=recovery)
    if plan.get("mode") != Mode.IN_PROCESS.value:
        return replace(done, reason=_why(old) or "group rank 0 restarts the workers"), None
    return done, plan


def member_transition(ctx: SwitchContext, old: RendezvousInfo, generation: int) -> TransitionDone:
    """A running member's part of a planned change: background round, then switch."""
    done, plan = _join_next(ctx, old, generation, recovery=False)
    if plan is None:
        return done
    assert done.info is not None and done.assignment is not None
    try:
        return _switch(ctx, old, done.info, done.assignment, str(plan["prefix"]), done)
    except RendezvousError as exc:
        return replace(done, reason=f"the switch failed: {type(exc).__name__}: {exc}")


def _switch(ctx: SwitchContext, old: RendezvousInfo, info: RendezvousInfo,
            assignment: Assignment, prefix: str, done: TransitionDone) -> TransitionDone:
    link, group_rank = ctx.link, assignment.group_rank
    link.forget("switched", "missed", "failed", "progress")
    if not link.send_all(lambda lr: worker_plan(assignment, lr, prefix)):
        return replace(done, reason="a worker is no longer connected to its agent")
    info.store.set(f"{READY_DIR}{group_rank}", json.dumps(
        {"newcomer": False, "offset": assignment.rank_offset, "nproc": ctx.nproc}))
    if group_rank == 0:
        _coordinate(ctx, old, info)
    raw = wait_key(old.store, SWITCH_KEY, ctx.switch_timeout + QUERY_TIMEOUT)
    if raw is None:
        return replace(done, reason=f"no switch step within {ctx.switch_timeout:g} s")
    decision = loads_entry(SWITCH_KEY, raw)
    if decision.get("restart"):
        return replace(done, reason=str(decision.get("why", "")))
    step = int(decision["step"])
    link.send_all(lambda lr: {**decision, "op": "switch"})
    ctx.say(f"round formed in {done.formed_ms:.0f} ms; switching at step {step}")
    return _await_switch(ctx, replace(done, switch_step=step))


def _wait_ready(ctx: SwitchContext, old: RendezvousInfo,
                info: RendezvousInfo) -> dict[str, dict[str, Any]] | None:
    """Group rank 0: every node's ready entry, or None (a restart announced) after the timeout."""
    store, deadline = info.store, time.monotonic() + ctx.switch_timeout
    while True:
        ready = store.list_keys(READY_DIR)
        if len(ready) >= info.world_size:
            return {key: loads_entry(key, raw) for key, raw in ready.items()}
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            announce(old, info, {"restart": True, "why": (
                f"{info.world_size - len(ready)} node(s) not ready to switch within "
                f"{ctx.switch_timeout:g} s (--switch-timeout)")})
            return None
        since = store.revision(READY_DIR)
        if store.count_keys(READY_DIR) == len(ready):
            store.watch(READY_DIR, since, min(WAIT_SLICE, remaining))


def _newcomer_ranks(ready: dict[str, dict[str, Any]]) -> list[int]:
    return [rank for entry in ready.values() if entry.get("newcomer")
            for rank in range(int(entry["offset"]), int(entry["offset"]) + int(entry["nproc"]))]


def _coordinate(ctx: SwitchContext, old: RendezvousInfo, info: RendezvousInfo) -> None:
    """Group rank 0 of a planned change: once every node is ready, pick the switch step."""
    ready = _wait_ready(ctx, old, info)
    if ready is None:
        return
    ctx.link.forget("progress")
    ctx.link.send(0, {"op": "query"})
    progress = ctx.link.wait_one(0, "progress", QUERY_TIMEOUT)
    if progress is None:
        announce(old, info, {"restart": True, "why": "the coordinating worker did not report "
                                                     "its step"})
        return
    step = switch_step(int(progress["step"]), progress.get("step_time"), LEAD_SECONDS)
    announce(old, info, {"step": step, "source": 0, "receivers": sorted(_newcomer_ranks(ready))})


def _coordinate_recovery(ctx: SwitchContext, old: RendezvousInfo, info: RendezvousInfo) -> None:
    """Group rank 0 after a loss: once every node is ready, name the survivor whose state all
    adopt (``recovery_plan``)."""
    ready = _wait_ready(ctx, old, info)
    if ready is None:
        return
    steps = {int(entry["offset"]) + i: int(step) for entry in ready.values()
             if not entry.get("newcomer") for i, step in enumerate(entry["steps"])}
    source, step, receivers = recovery_plan(steps, _newcomer_ranks(ready))
    announce(old, info, {"recover": True, "step": step, "source": source,
                         "receivers": receivers})


def _await_switch(ctx: SwitchContext, done: TransitionDone) -> TransitionDone:
    bad = ctx.link.wait_all("switched", ctx.switch_timeout,
                            {"missed", "failed", "closed", "broken"})
    if bad is not None:
        errors = [str((ctx.link.said(lr, "failed") or {}).get("error", ""))
                  for lr in range(ctx.nproc)]
        why = {"missed": "a worker was already past the switch step",
               "failed": f"a worker failed to switch: {'; '.join(e for e in errors if e)}",
               "closed": "a worker exited during the switch",
               "broken": "a worker's process group failed during the switch",
               "timeout": f"the workers did not switch within {ctx.switch_timeout:g} s "
                          "(--switch-timeout)"}[bad]
        return replace(done, reason=why)
    pauses = [float((ctx.link.said(lr, "switched") or {}).get("ms", 0)) for lr in range(ctx.nproc)]
    return replace(done, mode=Mode.IN_PROCESS, pause_ms=max(pauses, default=0.0))


def recovery_transition(ctx: SwitchContext, old: RendezvousInfo,
                        generation: int) -> TransitionDone:
    """A member whose group lost a member: its workers are stopped (their group aborted), the
    next round forms without the lost node, and every survivor enters the new group and adopts
    the state of the most advanced survivor."""
    ctx.link.send_all(lambda lr: {"op": "abort"})
    done, plan = _join_next(ctx, old, generation, recovery=True)
    if plan is None:
        return done
    info, assignment, formed_ms = done.info, done.assignment, done.formed_ms or 0.0
    assert info is not None and assignment is not None
    link, group_rank = ctx.link, assignment.group_rank
    try:
        link.send_all(lambda lr: worker_plan(assignment, lr, str(plan["prefix"])))
        if link.wait_all("broken", ctx.switch_timeout, {"closed", "failed"}) is not None:
            return replace(done, reason="a worker did not report its failed group",
                           switch_step=-1)
        steps = [int((link.said(lr, "broken") or {}).get("step", 0)) for lr in range(ctx.nproc)]
        link.forget("broken")  # from now on, a break is a failure of the recovery itself
        info.store.set(f"{READY_DIR}{group_rank}", json.dumps(
            {"newcomer": False, "offset": assignment.rank_offset, "nproc": ctx.nproc,
             "steps": steps}))
        if group_rank == 0:
            _coordinate_recovery(ctx, old, info)
        raw = wait_key(old.store, SWITCH_KEY, ctx.switch_timeout + QUERY_TIMEOUT)
    except RendezvousError as exc:
        return replace(done, reason=f"the recovery failed: {type(exc).__name__}: {exc}",
                       switch_step=-1)
    if raw is None:
        return replace(done, reason=f"no recovery plan within {ctx.switch_timeout:g} s",
                       switch_step=-1)
    decision = loads_entry(SWITCH_KEY, raw)
    if decision.get("restart"):
        return replace(done, reason=str(decision.get("why", "")))
    link.forget("switched")
    link.send_all(lambda lr: {**decision, "op": "recover"})
    ctx.say(f"the next round formed in {formed_ms:.0f} ms; the survivors go on "
            f"from step {decision['step']} (the state of global rank {decision['source']})")
    return _await_switch(ctx, replace(done, switch_step=int(decision["step"])))


def _next_round(ctx: SwitchContext, started: float) -> RendezvousInfo:
    """The next round, saying every so often that the survivors wait (below min_nodes)."""
    future = ctx.handler.next_rendezvous_async()
    while True:
        try:
            return future.result(timeout=PROGRESS_INTERVAL)
        except TimeoutError:
            ctx.say(f"the survivors wait for enough nodes to re-form ("
                    f"{time.monotonic() - started:.0f} s); training resumes in-process then")


def newcomer_transition(ctx: SwitchContext, info: RendezvousInfo, assignment: Assignment,
                        generation: int) -> TransitionDone:
    """A newcomer whose workers were started to join the running group: ready, then wait."""
    done = TransitionDone(generation, info, assignment)
    if ctx.link.wait_all("hello", ctx.switch_timeout, {"closed"}) is not None:
        return replace(done, reason="the workers did not connect to their agent (do they use "
                                  "rdzv.torch.ElasticState?)")
    try:
        info.store.set(f"{READY_DIR}{assignment.group_rank}", json.dumps(
            {"newcomer": True, "offset": assignment.rank_offset, "nproc": ctx.nproc}))
        raw = wait_key(info.store, JOIN_KEY, ctx.switch_timeout + QUERY_TIMEOUT)
    except RendezvousError as exc:
        return replace(done, reason=f"cannot reach the round's store: {exc}")
    if raw is None:
        return replace(done, reason=f"no switch step within {ctx.switch_timeout:g} s")
    decision = loads_entry(JOIN_KEY, raw)
    if decision.get("restart"):
        return replace(done, reason=str(decision.get("why", "")))
    ctx.link.send_all(lambda lr: {"op": "join", "source": int(decision.get("source", 0))})
    ctx.say(f"joining the running group at its step {decision['step']}")
    return _await_switch(ctx, replace(done, switch_step=int(decision["step"])))


def wait_for_switch(old: RendezvousInfo, timeout: float) -> dict[str, Any] | None:
    """A leaving node: the decision of the round formed without it, or None after ``timeout``."""
    raw = wait_key(old.store, SWITCH_KEY, timeout)
    return None if raw is None else loads_entry(SWITCH_KEY, raw)

