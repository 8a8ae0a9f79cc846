"""The chaos soak's invariants: pure functions over the merged histories (no I/O, no clock).

A history is a list of events (JSON objects), each with ``t`` (wall-clock seconds) and ``ev``.
Node events carry ``node`` (the harness's name of the node process, stable across its store
sessions):

* ``waiting``: the node calls ``next_rendezvous()``; ``spare``: it now waits as a spare;
* ``joined``: it got ``round``, ``rank`` and ``world`` (its world size);
* ``members``: the member set it read back through the round's store, ``members`` (one name
  per rank, None where a member never wrote), and ``conflict`` (a name found under its own
  rank that is not its own, else None);
* ``step``: it trained in ``round`` and saw no membership change;
* ``waiting``, ``spare``, ``joined`` and ``seal_pause`` carry the engine's ``node_id`` (a new
  one after the node's session expired);
* ``error``: an exception of ``type``, ``expected`` or not, with ``message``;
* ``left`` (a graceful leave), ``closed``, ``seal_pause`` (it stopped itself while sealing).

The harness records ``start`` (a node process started) and ``resumed`` (SIGCONT) with ``node``,
and without: ``fault`` (``kind``, ``target``), ``server_up`` (after a restart), ``ack_check``
(``acked``, ``missing``: the checker's acknowledged writes read back), ``faults_end``,
``decision`` (the audit: round ``round``'s ``status`` and ``ranks``, its rank records by node
id, as the store holds them at the end) and ``end`` (``alive``: the nodes alive at the end).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

Event = dict[str, Any]

ROUNDS_PER_CHANGE = 4
"""Rounds a membership change (a fault or a join) may cause before the soak calls it a livelock."""


@dataclass(frozen=True)
class Limits:
    """What the run promised: node bounds, and how soon after the faults a common round forms."""

    min_nodes: int
    max_nodes: int
    recovery_bound: float
    """Seconds after ``faults_end`` within which every alive node is in one round."""
    hold: float
    """Seconds the final round must hold (no newer round) before the end."""


@dataclass(frozen=True)
class Violation:
    check: str
    message: str
    round: int | None = None
    events: tuple[Event, ...] = field(default=())

    def describe(self) -> str:
        where = f" round {self.round}" if self.round is not None else ""
        lines = [f"VIOLATION {self.check}{where}: {self.message}"]
        lines += [f"    {event}" for event in self.events[:12]]
        if len(self.events) > 12:
            lines.append(f"    ... {len(self.events) - 12} more")
        return "\n".join(lines)


def of_kind(events: Iterable[Event], *kinds: str) -> list[Event]:
    return [e for e in events if e["ev"] in kinds]


def by_round(events: Iterable[Event], kind: str) -> dict[int, list[Event]]:
    grouped: dict[int, list[Event]] = defaultdict(list)
    for event in of_kind(events, kind):
        grouped[event["round"]].append(event)
    return dict(sorted(grouped.items()))


# -- safety ----------------------------------------------------------------------------------
def check_decisions(events: list[Event], limits: Limits) -> list[Violation]:
    """One decision per round: its members agree on the world size and the member set, ranks are
    distinct and within 0..W-1 (exactly 0..W-1 once every member wrote), W within the bounds."""
    found = []
    members_of = by_round(events, "members")
    for r, joins in by_round(events, "joined").items():
        worlds = sorted({e["world"] for e in joins})
        ranks = Counter(e["rank"] for e in joins)
        if len(worlds) > 1:
            found.append(Violation("one-decision", f"members disagree on the world size: "
                                   f"{worlds} (two decisions)", r, tuple(joins)))
        if any(count > 1 for count in ranks.values()):
            found.append(Violation("one-decision", "two members hold the same rank: "
                                   f"{sorted(k for k, c in ranks.items() if c > 1)}", r,
                                   tuple(joins)))
        if any(not 0 <= e["rank"] < e["world"] for e in joins):
            found.append(Violation("one-decision", "a rank outside 0..W-1", r, tuple(joins)))
        if any(not limits.min_nodes <= w <= limits.max_nodes for w in worlds):
            found.append(Violation("world-size", f"world size {worlds} outside "
                                   f"[{limits.min_nodes}, {limits.max_nodes}]", r, tuple(joins)))
        seen = members_of.get(r, [])
        complete = {tuple(e["members"]) for e in seen if None not in e["members"]}
        conflicts = [e for e in seen if e.get("conflict")]
        if len(complete) > 1 or conflicts:
            found.append(Violation("one-decision", "members read back different member sets "
                                   f"{sorted(complete)} or found another node under their rank",
                                   r, tuple(joins + seen)))
    return found


def names(events: Iterable[Event]) -> dict[str, str]:
    """The node (its harness name) of every engine node id seen."""
    return {e["node_id"]: e["node"] for e in events if e.get("node_id")}


def check_store_decisions(events: list[Event]) -> list[Violation]:
    """The decision each round's store holds at the end (``decision`` events: its status and
    the rank keys left) is the one its members trained with: same world size, and no rank of
    a member given to another node (a second, stale decision written over the first)."""
    found = []
    joins, who = by_round(events, "joined"), names(events)
    for audit in of_kind(events, "decision"):
        r, members = audit["round"], joins.get(audit["round"], [])
        worlds = {e["world"] for e in members}
        holder = {e["rank"]: e["node_id"] for e in members}
        status, problems = audit["status"], []
        if status and "world_size" in status and worlds and status["world_size"] not in worlds:
            problems.append(f"its status says world size {status['world_size']}")
        for node_id, record in sorted(audit["ranks"].items()):
            rank, world = record["rank"], record["world_size"]
            if worlds and world not in worlds or holder.get(rank, node_id) != node_id:
                problems.append(f"its rank key gives {who.get(node_id, node_id)} ({node_id}) "
                                f"rank {rank} of {world}")
        if problems:
            trained = ", ".join(f"{e['node']} rank {e['rank']} of {e['world']}" for e in members)
            found.append(Violation("one-decision", "two decisions: the members trained as "
                                   f"{trained}, but {'; '.join(problems)}", r,
                                   tuple(members) + (audit,)
                                   + tuple(of_kind(events, "seal_pause"))))
    return found


def check_groups(events: list[Event]) -> list[Violation]:
    """No node in two groups at once: each node's rounds only go up, and a round's member set
    (as read back from its store) names only nodes that joined that round."""
    found = []
    last: dict[str, Event] = {}
    for event in of_kind(events, "joined"):
        before = last.get(event["node"])
        if before is not None and event["round"] <= before["round"]:
            found.append(Violation("two-groups", f"{event['node']} joined round "
                                   f"{event['round']} after round {before['round']}",
                                   event["round"], (before, event)))
        last[event["node"]] = event
    joined = {(e["round"], e["node"]) for e in of_kind(events, "joined")}
    for event in of_kind(events, "members"):
        strangers = [n for n in event["members"] if n is not None and (event["round"], n)
                     not in joined]
        if strangers:
            found.append(Violation("two-groups", f"member set names {strangers}, who did not "
                                   "join this round", event["round"], (event,)))
    return found


def check_exceptions(events: list[Event]) -> list[Violation]:
    return [Violation("exception", f"{e['node']}: unexpected {e['type']}: {e['message']}",
                      None, (e,)) for e in of_kind(events, "error") if not e["expected"]]


def check_acked(events: list[Event]) -> list[Violation]:
    return [Violation("acked-data", f"{e['missing']} of {e['acked']} acknowledged writes "
                      "missing after a server restart", None, (e,))
            for e in of_kind(events, "ack_check") if e["missing"]]


# -- progress --------------------------------------------------------------------------------
def changes(events: list[Event]) -> int:
    """Membership changes the harness caused: faults and the nodes it started."""
    return len(of_kind(events, "fault")) + len(of_kind(events, "start"))


def check_livelock(events: list[Event]) -> list[Violation]:
    """Rounds must not churn without membership changes: at most ROUNDS_PER_CHANGE per change."""
    rounds = len(by_round(events, "joined"))
    bound = ROUNDS_PER_CHANGE * (changes(events) + 1)
    if rounds <= bound:
        return []
    return [Violation("livelock", f"{rounds} rounds formed for {changes(events)} faults and "
                      f"joins (bound {bound})", None,
                      tuple(of_kind(events, "joined")[-12:]))]


@dataclass(frozen=True)
class Settled:
    """Where the alive nodes stand: one common round, or not."""

    round: int | None
    members: tuple[str, ...]
    spares: tuple[str, ...]
    since: float
    """When the common round formed (its last ``joined``)."""
    problem: str


def settled(events: list[Event], alive: Iterable[str], limits: Limits) -> Settled:
    """Whether every alive node is a member of one common round (or a spare beside a full one)."""
    state: dict[str, Event] = {}
    for event in events:
        if event.get("node") is not None and event["ev"] in ("waiting", "spare", "joined",
                                                             "error", "left", "closed"):
            state[event["node"]] = event
    alive = sorted(alive)
    members = [n for n in alive if n in state and state[n]["ev"] == "joined"]
    spares = [n for n in alive if n in state and state[n]["ev"] == "spare"]
    rounds = {state[n]["round"] for n in members}
    if len(rounds) != 1:
        return Settled(None, (), tuple(spares), 0.0, f"members in rounds {sorted(rounds)}")
    r = rounds.pop()
    joins = by_round(events, "joined")[r]
    world, since = joins[0]["world"], max(e["t"] for e in joins)
    others = [n for n in alive if n not in members and n not in spares]
    if others:
        problem = "nodes not in the round: " + ", ".join(
            f"{n} ({state[n]['ev'] if n in state else 'no event'})" for n in others)
    elif len(members) != world:
        problem = f"{len(members)} alive members in a round of world size {world}"
    elif spares and world != limits.max_nodes:
        problem = f"spares {spares} wait beside a round of {world} < max_nodes"
    else:
        problem = ""
    return Settled(r, tuple(members), tuple(spares), since, problem)


def check_liveness(events: list[Event], limits: Limits) -> list[Violation]:
    """Every node alive at the end is in one common round, formed within the recovery bound
    after the faults stopped, and that round held for ``hold`` seconds (no newer round)."""
    end, faults_end = of_kind(events, "end"), of_kind(events, "faults_end")
    if not end or not faults_end:
        return [Violation("liveness", "the run did not reach its end")]
    state = settled(events, end[-1]["alive"], limits)
    t_end, t_quiet = end[-1]["t"], faults_end[-1]["t"]
    last = of_kind(events, "joined")[-6:]
    if state.problem:
        return [Violation("liveness", f"no common round at the end: {state.problem}",
                          state.round, tuple(last))]
    if state.since > t_quiet + limits.recovery_bound:
        return [Violation("liveness", f"the common round formed {state.since - t_quiet:.1f} s "
                          f"after the faults stopped (bound {limits.recovery_bound:g} s)",
                          state.round, tuple(last))]
    if t_end - state.since < limits.hold:
        return [Violation("livelock", f"the final round held only {t_end - state.since:.1f} s "
                          f"(needs {limits.hold:g} s)", state.round, tuple(last))]
    return []


def until_end(events: list[Event]) -> list[Event]:
    """The events in time order up to the run's ``end`` (what the nodes did while the harness
    stopped them is not part of the run)."""
    events = sorted(events, key=lambda e: e["t"])
    ends = of_kind(events, "end")
    return [e for e in events if e["t"] <= ends[-1]["t"]] if ends else events


def check_all(events: list[Event], limits: Limits) -> list[Violation]:
    events = until_end(events)
    return (check_decisions(events, limits) + check_store_decisions(events)
            + check_groups(events) + check_exceptions(events)
            + check_acked(events) + check_livelock(events) + check_liveness(events, limits))


# -- figures ---------------------------------------------------------------------------------
def recoveries(events: list[Event]) -> list[float]:
    """Seconds from each server kill until every node that was training just before it had
    recovered (trained, joined a round, or waits as a spare beside a full one) after the server
    was back; a node hit by another fault before it recovered is left out (``events`` in time
    order)."""
    progress = of_kind(events, "joined", "step", "spare")
    found = []
    for kill in (f for f in of_kind(events, "fault") if f["kind"] == "server"):
        up = next((e["t"] for e in of_kind(events, "server_up") if e["t"] >= kill["t"]), None)
        if up is None:
            continue
        active = {e["node"] for e in progress if kill["t"] - 2.0 <= e["t"] <= kill["t"]}
        back: dict[str, float] = {}
        for event in progress:
            if event["t"] > up and event["node"] in active:
                back.setdefault(event["node"], event["t"])
        hit = {(f["target"], f["t"]) for f in of_kind(events, "fault") if f["t"] > kill["t"]}
        times = [t for node, t in back.items()
                 if not any(target == node and when < t for target, when in hit)]
        if times:
            found.append(max(times) - kill["t"])
    return found


def figures(events: list[Event]) -> dict[str, Any]:
    events = until_end(events)
    errors = of_kind(events, "error")
    recovered = recoveries(events)
    return {
        "rounds": len(by_round(events, "joined")),
        "nodes started": len(of_kind(events, "start")),
        "faults": dict(sorted(Counter(f["kind"] for f in of_kind(events, "fault")).items())),
        "sealers paused mid-seal": len(of_kind(events, "seal_pause")),
        "graceful leaves": len(of_kind(events, "left")),
        "expected exceptions": dict(sorted(Counter(e["type"] for e in errors
                                                   if e["expected"]).items())),
        "acknowledged writes checked": sum(e["acked"] for e in of_kind(events, "ack_check")),
        "longest recovery after a server restart (s)": round(max(recovered), 2)
        if recovered else None,
    }
