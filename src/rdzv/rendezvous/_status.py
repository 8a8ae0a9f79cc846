"""Reading the state of a run from its store, for ``rdzv status``: read-only, no handler needed.

It follows the dynamic engine's key layout (``_layout.py``): the last sealed round, its members
(rank keys) and their liveness (the ``expect`` keys of the next round), the round forming now.
Hosts, pids and join times come from the entries agents write to the round's own store
(``round/<r>/user/agent/node/<group rank>``), so runs started without ``rdzv run`` show fewer
details.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import RendezvousStateError
from ..store import Store
from ._api import RendezvousParameters
from ._layout import (
    AGENT_ALIVE,
    AGENT_LEAVING,
    AGENT_NODES,
    AGENT_STRAGGLERS,
    ROOT,
    RunKeys,
    decode_int,
    decode_rank,
    decode_status,
)
from ._params import canonical_backend


@dataclass(frozen=True)
class MemberStatus:
    """A member of the last sealed round."""

    rank: int
    alive: bool
    """Its liveness key still exists (its store session is open and heartbeating)."""
    host: str | None = None
    pid: int | None = None
    nproc: int | None = None
    role: str | None = None
    started_s_ago: float | None = None
    """Seconds since its agent started (agents of older versions: since it joined this
    round)."""
    last_seen_s_ago: float | None = None
    """Seconds since its agent last wrote its sign of life (every few seconds while it runs)."""
    join_s: float | None = None
    """How long its join took."""
    leaving: bool = False
    """It announced that it leaves (graceful scale-in): the next round forms without it."""
    step: int | None = None
    step_time: float | None = None
    """Seconds per step of its workers, as of its last sign of life."""
    compute: float | None = None
    """Of ``step_time``: its workers' own work (the rest: waiting for the other nodes)."""
    straggler: float | None = None
    """Flagged as a straggler: its work per step over the other nodes' (None: not flagged)."""


@dataclass(frozen=True)
class RunStatus:
    """A run at a glance."""

    run_id: str
    closed: bool
    round: int | None
    """The last sealed round (None: no round has formed yet)."""
    world_size: int = 0
    master: str | None = None
    members: list[MemberStatus] = field(default_factory=list)
    forming_round: int = 0
    waiting: int = 0
    """Nodes joined to the forming round (newcomers and members coming back)."""
    rejoined: int = 0
    armed: bool = False
    last_round_s: float | None = None
    """The longest join among the members of the last round (None: unknown)."""
    max_nodes: int | None = None
    """The job's maximum size, as its agents say (None: unknown)."""

    @property
    def spares(self) -> int:
        """Nodes waiting that cannot join: the round is full and none of its members moves on."""
        if self.max_nodes is None or self.world_size < self.max_nodes or self.rejoined:
            return 0
        if any(not m.alive or m.leaving for m in self.members):
            return 0
        return self.waiting

    @property
    def state(self) -> str:
        if self.closed:
            return "closed"
        if self.round is None:
            return "forming"
        if self.waiting > self.spares:
            return "re-forming"
        return "complete"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state, "spares": self.spares}

    def without_ages(self) -> dict[str, Any]:
        """:meth:`as_dict` less the ages that grow by themselves: equal means nothing happened."""
        shape = self.as_dict()
        shape["members"] = [
            {k: v for k, v in m.items() if k not in ("started_s_ago", "last_seen_s_ago", "step",
                                                     "step_time", "compute")}
            for m in shape["members"]
        ]
        return shape


def read_status(store: Store, run_id: str, now: float | None = None) -> RunStatus:
    """The state of run ``run_id`` in ``store``."""
    keys = RunKeys(run_id)
    now = time.time() if now is None else now
    closed = store.try_get(keys.closed) is not None
    sealed = decode_int(keys.sealed, store.try_get(keys.sealed), -1)
    forming = sealed + 1
    common = dict(
        run_id=run_id,
        closed=closed,
        forming_round=forming,
        waiting=store.count_keys(keys.nodes(forming)),
        rejoined=store.count_keys(keys.back_dir(forming)),
        armed=store.try_get(keys.armed(forming)) is not None,
    )
    if sealed < 0:
        return RunStatus(round=None, **common)  # type: ignore[arg-type]
    decision = decode_status(keys.status(sealed), store.try_get(keys.status(sealed)))
    world_size, master = 0, None
    if not isinstance(decision, bool) and decision is not None:
        world_size = decision.world_size
        master = f"{decision.master_addr}:{decision.master_port}"
    rank_dir = keys.round(sealed) + "rank/"
    alive = {key.rsplit("/", 1)[1] for key in store.list_keys(keys.expect_dir(forming))}
    agents_dir = f"{keys.user(sealed)}/{AGENT_NODES}"
    agents: dict[int, dict[str, Any]] = {}
    for key, raw in store.list_keys(agents_dir).items():
        try:
            entry = json.loads(raw)
            agents[int(key[len(agents_dir):])] = entry if isinstance(entry, dict) else {}
        except ValueError:
            continue  # not an agent's entry: show the member without details
    seen_dir = f"{keys.user(sealed)}/{AGENT_ALIVE}"
    last_seen: dict[int, float] = {}
    perf: dict[int, dict[str, Any]] = {}
    for key, raw in store.list_keys(seen_dir).items():
        try:
            entry = json.loads(raw)
            rank = int(key[len(seen_dir):])
            stamp = entry.get("time")
        except (ValueError, AttributeError):
            continue  # not an agent's entry: its age stays unknown
        if isinstance(stamp, (int, float)):
            last_seen[rank] = stamp
        perf[rank] = {name: entry[name] for name in ("step", "step_time", "compute")
                      if isinstance(entry.get(name), (int, float))}
    stragglers_dir = f"{keys.user(sealed)}/{AGENT_STRAGGLERS}"
    stragglers: dict[int, float] = {}
    for key, raw in store.list_keys(stragglers_dir).items():
        try:
            stragglers[int(key[len(stragglers_dir):])] = float(json.loads(raw)["ratio"])
        except (ValueError, KeyError, TypeError):
            continue
    leaving_dir = f"{keys.user(sealed)}/{AGENT_LEAVING}"
    leaving = {key[len(leaving_dir):] for key in store.list_keys(leaving_dir)}
    # A member's rank key goes once it joins the next round (in the background while its
    # workers run); its agent's entry stays with the round.
    node_ids: dict[int, str | None] = {}
    for key, raw in store.list_keys(rank_dir).items():
        rank, _ = decode_rank(key, raw)
        node_ids[rank] = key[len(rank_dir):]
    for rank in agents:
        node_ids.setdefault(rank, None)
    members = []
    for rank, node_id in node_ids.items():
        entry = agents.get(rank, {})
        stamp = entry.get("started") or entry.get("time")
        members.append(MemberStatus(
            rank=rank,
            alive=node_id in alive if node_id is not None else rank in last_seen,
            host=entry.get("host"),
            pid=entry.get("pid"),
            nproc=entry.get("nproc"),
            role=entry.get("role"),
            started_s_ago=round(now - stamp, 3) if isinstance(stamp, (int, float)) else None,
            last_seen_s_ago=round(now - last_seen[rank], 3) if rank in last_seen else None,
            join_s=entry.get("join_s"),
            leaving=str(rank) in leaving,
            straggler=stragglers.get(rank),
            **perf.get(rank, {}),
        ))
    members.sort(key=lambda m: m.rank)
    joins = [m.join_s for m in members if isinstance(m.join_s, (int, float))]
    maxima = {e.get("max_nodes") for e in agents.values()} - {None}
    return RunStatus(round=sealed, world_size=world_size, master=master, members=members,
                     last_round_s=max(joins) if joins else None,
                     max_nodes=maxima.pop() if len(maxima) == 1 else None,
                     **common)  # type: ignore[arg-type]


LIST_RUNS_UP_TO = 20000
"""Keys a store may hold for :func:`known_runs` to list its runs (each key is read)."""


def known_runs(store: Store) -> list[str] | None:
    """The run ids that have keys in ``store`` (None: too many keys to list them cheaply)."""
    root = f"{ROOT}/"
    if store.count_keys(root) > LIST_RUNS_UP_TO:
        return None
    return sorted({key[len(root):].split("/", 1)[0] for key in store.list_keys(root)})


def unknown_run(store: Store, run_id: str) -> str | None:
    """Why ``run_id`` cannot be shown, if ``store`` has never seen it (None: it has)."""
    if store.count_keys(RunKeys(run_id).base):
        return None
    runs = known_runs(store)
    known = ("it holds no run yet" if runs == [] else "it holds too many keys to list its runs"
             if runs is None else f"the runs it knows: {', '.join(runs[:20])}"
             + (f" (and {len(runs) - 20} more)" if len(runs) > 20 else ""))
    return (f"this store has no run {run_id!r} ({known}); check --rdzv-id (or the run in the "
            "URL); a run appears once its first node joins")


def format_status(status: RunStatus) -> str:
    """``status`` as a few lines for a person."""
    lines = [f"run {status.run_id}: {status.state}"]
    if status.round is None:
        lines.append(f"  no round has formed yet; {status.waiting} node(s) joined round 0"
                     + (" (min_nodes reached, last call running)" if status.armed else ""))
        return "\n".join(lines)
    took = (f", its slowest node joined in {status.last_round_s:.2f} s"
            if status.last_round_s is not None else "")
    lines.append(f"  round {status.round}: {status.world_size} node(s){took}; workers' master "
                 f"{status.master or '?'}")
    lines.append(f"  {'rank':>4}  {'alive':7}  {'host':24} {'pid':>8}  {'workers':>7}  "
                 f"{'up':>8}  {'seen':>8}  {'step':>7}  {'s/step':>7}  {'work':>7}")
    for member in status.members:
        up = f"{member.started_s_ago:.0f} s" if member.started_s_ago is not None else "?"
        seen = (f"{member.last_seen_s_ago:.0f} s ago" if member.last_seen_s_ago is not None
                else "?")
        step = str(member.step) if member.step is not None else "-"
        step_time = f"{member.step_time:.3f}" if member.step_time is not None else "-"
        work = f"{member.compute:.3f}" if member.compute is not None else "-"
        flag = (f"  straggler ({member.straggler:.1f}x the others' work)"
                if member.straggler is not None else "")
        lines.append(f"  {member.rank:>4}  {_liveness(member, status):7}  "
                     f"{member.host or '?':24} {member.pid or '?':>8}  "
                     f"{member.nproc or '?':>7}  {up:>8}  {seen:>8}  {step:>7}  "
                     f"{step_time:>7}  {work:>7}{flag}")
    if status.spares:
        lines.append(f"  {status.spares} spare node(s) waiting: the job runs at its maximum of "
                     f"{status.max_nodes}; a spare takes the place of a member that leaves or "
                     "is lost")
    elif status.waiting:
        lines.append(f"  {status.waiting} node(s) waiting in round {status.forming_round} "
                     f"({status.rejoined} of them members coming back)")
    return "\n".join(lines)


def open_store(params: RendezvousParameters) -> Store:
    """A read-only client of the store of ``params``' backend (file, tcp/c10d, etcd, memory)."""
    if params.backend == "file":
        from ..store import FileStore
        from ._file import store_path

        return FileStore(store_path(params.endpoint, params.run_id),
                         timeout=params.get_option("read_timeout"), read_only=True)
    if canonical_backend(params.backend) == "tcp":
        from ..kv.auth import shared_secret
        from ..store import TCPStore
        from ._tcp import split_endpoint

        host, port = split_endpoint(params.endpoint)
        return TCPStore(host, port, is_master=False, timeout=params.get_option("read_timeout"),
                        secret=shared_secret(params.get_option("secret_file")))
    if params.backend == "memory":
        from ._memory import shared_store

        return shared_store(params.endpoint).client()
    if params.backend == "etcd":
        from ._etcd import open_store as open_etcd_store

        return open_etcd_store(params, lease=False)
    raise RendezvousStateError(
        f"rdzv status reads the tcp, etcd, file and memory backends; {params.backend!r} is "
        "not one"
    )


def _liveness(member: MemberStatus, status: RunStatus) -> str:
    if member.leaving and not status.closed:
        return "leaving"
    if member.alive:
        return "yes"
    return "left" if status.closed else "LOST"
