"""What the executor does for the workers' health (the rules are ``_hang.py`` and
``_stragglers.py``): report a hung worker and end it; publish this node's step times with its
sign of life; on group rank 0, compare the nodes and flag (or replace) a straggler.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import RendezvousError
from ..rendezvous import AGENT_ALIVE, AGENT_EVICT, AGENT_STRAGGLERS, RendezvousInfo
from ._crew import Crew
from ._host import NodeHost
from ._history import record
from ._protocol import Evicted, Node, Worker
from ._round import mark_alive
from ._stragglers import Policy, Sample, Watch, assess

logger = logging.getLogger(__name__)

TOP_FRAMES = 12
"""Lines of the hung thread's stack kept in the history's ``worker_hung`` event."""
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")


@dataclass(frozen=True)
class PerfSeen:
    """Event (group rank 0): every node's sign of life in round ``gen`` was read."""

    gen: int
    samples: list[Sample]
    spares: int


def node_perf(node: Node) -> dict[str, Any]:
    """This node's step times for its sign of life: the slowest training worker's work per step
    (the node's pace), the mean wait and step time, the highest step (empty: none training)."""
    slots = [s for s in node.slots if s.state is Worker.RUNNING and s.step_time is not None]
    if not slots:
        return {}
    computes = [s.compute for s in slots if s.compute is not None]
    waits = [s.wait for s in slots if s.wait is not None]
    return {"step": max(s.step or 0 for s in slots),
            "step_time": round(sum(s.step_time or 0.0 for s in slots) / len(slots), 6),
            "compute": round(max(computes), 6) if computes else None,
            "wait": round(sum(waits) / len(waits), 6) if waits else None}


def samples_of(entries: dict[str, bytes]) -> list[Sample]:
    """The nodes' signs of life (``AGENT_ALIVE`` keys -> entries) as samples; malformed ones
    are skipped."""
    samples = []
    for key, raw in entries.items():
        try:
            entry = json.loads(raw)
            rank = int(key.rsplit("/", 1)[1])
        except (ValueError, IndexError):
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("node"), str):
            continue
        compute = entry.get("compute")
        samples.append(Sample(rank, entry["node"], str(entry.get("host", "")),
                              float(compute) if isinstance(compute, (int, float)) else None))
    return sorted(samples, key=lambda s: s.group_rank)


def thread_stacks(text: str) -> list[list[str]]:
    """Python's faulthandler dump split into its threads' stacks (each: its header line, then
    its frames, innermost first)."""
    stacks: list[list[str]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            stacks.append([line])
        elif stacks and line.strip():
            stacks[-1].append(line)
    return stacks


def training_stack(text: str, frame: str) -> list[str]:
    """The training thread's stack in a dump: the thread at ``frame`` (``file:line in
    function``, from the worker's answer), else the main thread (the one that runs a
    ``<module>``), else the first."""
    stacks = thread_stacks(text)
    path, _, rest = frame.rpartition(":")
    line_no = rest.split(" ", 1)[0]
    wanted = f'File "{path}", line {line_no}' if path else None
    for stack in stacks:
        if wanted is not None and any(wanted in line for line in stack):
            return stack
    for stack in stacks:
        if any(line.endswith(" in <module>") for line in stack):
            return stack
    return stacks[0] if stacks else []


class Health:
    """The workers' health, for one node's executor."""

    def __init__(self, agent: NodeHost, crew: Crew, node_id: str) -> None:
        self._agent = agent
        self._crew = crew
        self._node_id = node_id
        config = agent.config
        self._policy = Policy(config.straggler_factor, config.replace_stragglers,
                              config.min_nodes)
        self._watch = Watch()
        self._gen = -1
        """The round whose store holds this node's straggler marks (group rank 0)."""
        self._asked = -1
        """The round in which this node was asked to leave (it acts once per round)."""
        self.ended: dict[int, str] = {}
        """Local rank -> why this node ended its worker (for the worker's failure)."""

    # -- signs of life and stragglers ------------------------------------------------------------
    def beat(self, info: RendezvousInfo, gen: int, node: Node, spares: int,
             post: Callable[[Any], None]) -> None:
        """This node's sign of life with its step times (on its membership watcher's thread);
        group rank 0 then reads every node's (:class:`PerfSeen`), the others whether they are
        asked to leave (:class:`~._protocol.Evicted`)."""
        perf = {"node": self._node_id, "host": self._agent.host, **node_perf(node)}
        mark_alive(info, perf)
        if info.rank == 0 and self._policy.factor > 0:
            post(PerfSeen(gen, samples_of(info.store.list_keys(AGENT_ALIVE)), spares))
        if self._policy.replace and self._asked != gen:  # (every node runs with the flag)
            asked = info.store.try_get(f"{AGENT_EVICT}{info.rank}")
            if asked is not None:
                self._asked = gen  # (once a round: a node that cannot leave says so once)
                post(Evicted(asked.decode(errors="replace")))

    def assess(self, handler: Any, info: RendezvousInfo, event: PerfSeen) -> None:
        """Group rank 0: flag, clear or replace stragglers (on the agent's thread)."""
        if event.gen != self._gen:  # a new round's store: its flags are written anew
            self._gen = event.gen
            for sample in event.samples:
                ratios = self._watch.ratios.get(sample.node)
                if sample.node in self._watch.flagged and ratios:
                    self._flag(info, sample, ratios[-1])
        self._watch, verdicts = assess(self._watch, event.samples, event.spares,
                                       self._agent.clock.monotonic(), self._policy)
        for verdict in verdicts:
            sample, ratio = verdict.sample, round(verdict.ratio, 3)
            where = f"group rank {sample.group_rank} ({sample.host})"
            if verdict.kind == "flagged":
                done = self._flag(info, sample, ratio)
                text = (f"{where} is a straggler: its work per step is {ratio:.2f}x the other "
                        f"nodes' (--straggler-factor {self._policy.factor:g})")
            elif verdict.kind == "cleared":
                done = self._write(info.store.delete_key, f"{AGENT_STRAGGLERS}{sample.group_rank}")
                text = f"{where} is no longer a straggler ({ratio:.2f}x)"
            else:
                why = f"a straggler at {ratio:.2f}x the others' work per step; a spare waits"
                done = self._write(info.store.set, f"{AGENT_EVICT}{sample.group_rank}", why)
                text = f"asking {where} to leave: {why}"
            if done:
                self._agent.say(text)
                record(handler, f"straggler_{verdict.kind}", straggler=sample.node,
                       group_rank=sample.group_rank, host=sample.host, ratio=ratio)

    def _flag(self, info: RendezvousInfo, sample: Sample, ratio: float) -> bool:
        return self._write(info.store.set, f"{AGENT_STRAGGLERS}{sample.group_rank}",
                           json.dumps({"ratio": round(ratio, 3), "node": sample.node}))

    @staticmethod
    def _write(action: Callable[..., Any], *args: Any) -> bool:
        try:
            action(*args)
        except RendezvousError as exc:
            logger.warning("cannot write the straggler mark %s: %s", args[0], exc)
            return False
        return True

    def hung(self, handler: Any, local_rank: int, rank: int | None, step: int | None,
             silent: float, why: str, frame: str) -> None:
        """Report a hung worker (every worker's stacks to the log, the training thread's to the
        history) and end it."""
        self.ended[local_rank] = f"hung at step {step}: no progress for {silent:.1f} s ({why})"
        try:
            self._report(handler, local_rank, rank, step, silent, why, frame)
        finally:
            self._crew.kill(local_rank)

    def _report(self, handler: Any, local_rank: int, rank: int | None, step: int | None,
                silent: float, why: str, frame: str) -> None:
        stacks = self._crew.stacks()
        who = f"worker rank {rank}" if rank is not None else "a worker"
        at = f" at {frame}" if frame else ""
        self._agent.say(f"{who} (local rank {local_rank}) is hung: no progress for {silent:.1f} "
                        f"s after step {step}; {why}{at}. The other ranks wait for it: ending "
                        "it (its stacks follow)")
        for lr, text in sorted(stacks.items()):
            whose = "the hung worker" if lr == local_rank else "another worker of this node"
            self._agent.say(f"stacks of local rank {lr} ({whose}):\n{text}")
        top = training_stack(stacks.get(local_rank, ""), frame)[:TOP_FRAMES]
        record(handler, "worker_hung", rank=rank, local_rank=local_rank, step=step,
               silent_s=silent, why=why, frame=frame or None, stack=top or None)
