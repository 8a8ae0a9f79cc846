"""A run's history as a timeline a person reads (``rdzv status --events``): pure formatting.

One line an event: its local time to the millisecond, the round, and what happened, e.g.
``23:41:07.120  round 3  formed in 8 ms: 3 node(s) (+host-c:311; host-b:207 left: heartbeat
missed)``.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from typing import Any, Callable

from ._history import RunEvent

_NODE_SUFFIX = re.compile(r":[0-9a-f]{8}$")
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def short_node(node: Any) -> str:
    """A node id without its random suffix (``host:pid``), for reading."""
    return _NODE_SUFFIX.sub("", node) if isinstance(node, str) else "?"


def format_seconds(seconds: Any) -> str:
    """``8 ms``, ``1.25 s``, ``2 min 5 s``; ``?`` if not a number of seconds (negative, not
    finite, or beyond a year)."""
    if (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
            or not 0 <= seconds < 366 * 86400):
        return "?"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.2f} s"
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def _reason(reason: Any) -> str:
    return str(reason).replace("_", " ")


def _round_formed(event: RunEvent) -> str:
    f = event.fields
    changes = [f"+{short_node(node)}" for node in f.get("newcomers") or []
               if f.get("cause") != "initial"]
    changes += [f"{short_node(entry.get('node'))} left: {_reason(entry.get('reason'))}"
                for entry in f.get("left") or [] if isinstance(entry, dict)]
    if f.get("cause") == "restart":
        changes.append("same members: restart")
    detail = f" ({'; '.join(changes)})" if changes else ""
    return (f"formed in {format_seconds(f.get('formation_s'))}: "
            f"{f.get('world_size', '?')} node(s){detail}")


def _worker_failed(event: RunEvent) -> str:
    f = event.fields
    how = (f"signal {f['signal']}" if "signal" in f else f"exit code {f.get('exit_code', '?')}")
    error = f": {f['error']}" if f.get("error") else ""
    return f"{short_node(event.node)}: worker rank {f.get('rank', '?')} failed with {how}{error}"


def _worker_hung(event: RunEvent) -> str:
    """The line, then the hung thread's stack (as recorded: innermost frame first)."""
    f = event.fields
    at = f" at {f['frame']}" if f.get("frame") else ""
    lines = [f"{short_node(event.node)}: worker rank {f.get('rank', '?')} hung after step "
             f"{f.get('step', '?')}: no progress for {format_seconds(f.get('silent_s'))}; "
             f"{f.get('why', '?')}{at}; the other ranks waited for it"]
    stack = f.get("stack")
    if isinstance(stack, list):
        lines += [f"{'':24}{line.strip()}" for line in stack if isinstance(line, str)]
    return "\n".join(lines)


def _straggler(event: RunEvent) -> str:
    f = event.fields
    node = f"{short_node(f.get('straggler'))} (group rank {f.get('group_rank', '?')})"
    ratio = f.get("ratio")
    slower = f"{ratio:.2f}x the others' work per step" if isinstance(ratio, (int, float)) else "?"
    if event.kind == "straggler_flagged":
        return f"{node} is a straggler: {slower}"
    if event.kind == "straggler_cleared":
        return f"{node} is no longer a straggler ({slower})"
    return f"{node} asked to leave as a straggler ({slower}): a spare takes its place"


def _switch(what: str) -> Callable[[RunEvent], str]:
    def text(event: RunEvent) -> str:
        f = event.fields
        step = f" at step {f['step']}" if f.get("step") is not None else ""
        return f"{short_node(event.node)} {what} in {format_seconds(f.get('pause_s'))}{step}"
    return text


_TEXT: dict[str, Callable[[RunEvent], str]] = {
    "round_formed": _round_formed,
    "node_waiting": lambda e: f"{short_node(e.node)} waiting to join",
    "spare_waiting": lambda e: (f"{short_node(e.node)} waiting as a spare (the job is at its "
                                f"maximum of {e.fields.get('max_nodes', '?')} nodes)"),
    "node_leaving": lambda e: f"{short_node(e.node)} leaving gracefully",
    "node_lost": lambda e: (f"{short_node(e.fields.get('lost'))} (rank "
                            f"{e.fields.get('rank', '?')}) lost: "
                            f"{_reason(e.fields.get('reason'))}, silent "
                            f"{format_seconds(e.fields.get('silent_s'))}; seen by "
                            f"{short_node(e.node)}"),
    "node_refused": lambda e: (f"{short_node(e.node)} refused: local rank "
                               f"{e.fields.get('local_rank', '?')} cannot take the job's "
                               f"training state ({e.fields.get('error', '?')})"),
    "workers_started": lambda e: (f"{short_node(e.node)} started {e.fields.get('nproc', '?')} "
                                  f"worker(s) (group rank {e.fields.get('group_rank', '?')}, "
                                  f"restarts {e.fields.get('restarts', 0)})"),
    "worker_failed": _worker_failed,
    "workers_restarted": lambda e: (f"{short_node(e.node)} restarting its workers (restart "
                                    f"{e.fields.get('restarts', '?')})"
                                    + (f": {e.fields['reason']}" if e.fields.get("reason")
                                       else "")),
    "restart_fallback": lambda e: (f"every worker restarts (the fallback, decided by "
                                   f"{short_node(e.node)}): {_reason(e.fields.get('cause', '?'))}"
                                   + (f": {e.fields['reason']}" if e.fields.get("reason")
                                      else "")),
    "worker_hung": _worker_hung,
    "straggler_flagged": _straggler,
    "straggler_cleared": _straggler,
    "straggler_replaced": _straggler,
    "switched_in_process": _switch("switched in-process"),
    "recovered_in_process": _switch("recovered in-process"),
    "training_paused": lambda e: (f"{short_node(e.node)} training paused "
                                  f"{format_seconds(e.fields.get('pause_s'))} "
                                  f"({_reason(e.fields.get('cause', '?'))})"),
    "run_closed": lambda e: (f"run closed by {short_node(e.node)}"
                             + (f" ({_reason(e.fields['reason'])})"
                                if e.fields.get("reason") else "")),
}


def format_event(event: RunEvent, *, utc: bool = False) -> str:
    """One line of the timeline: time (local, or UTC), round, what happened. An event whose
    values do not fit its kind (a hand-edited or foreign record) shows its raw JSON fields."""
    try:
        moment = time.gmtime(event.time) if utc else time.localtime(event.time)
        stamp = f"{time.strftime('%H:%M:%S', moment)}.{int(event.time * 1000) % 1000:03d}"
    except (TypeError, ValueError, OverflowError, OSError):
        stamp = "??:??:??.???"
    where = f"round {event.round}" if event.round is not None else ""
    text = _TEXT.get(event.kind)
    try:
        what = text(event) if text is not None else _raw(event)
    except (TypeError, ValueError, AttributeError, KeyError, OverflowError):
        what = _raw(event)
    return f"{stamp}  {where:9} {what}"


def _raw(event: RunEvent) -> str:
    return f"{event.kind} {short_node(event.node)} {json.dumps(event.fields, default=repr)}"


def parse_since(text: str, now: float) -> float:
    """The unix time ``--since`` names: a duration back from ``now`` (``90s``, ``10m``, ``2h``,
    ``1d``, a bare number of seconds), a local time today (``23:40``, ``23:40:07``), a local
    date and time (``2026-11-25 23:40``, ``2026-11-25T23:40:07``) or unix seconds (``@1764114000``).
    ValueError with an example if it is none of them."""
    raw = text.strip()
    match = _DURATION.match(raw)
    if match:
        return now - float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if raw.startswith("@"):
        try:
            return float(raw[1:])
        except ValueError:
            pass
    for layout in ("%H:%M", "%H:%M:%S"):
        try:
            clock = datetime.strptime(raw, layout).time()
        except ValueError:
            continue
        return datetime.combine(datetime.fromtimestamp(now).date(), clock).timestamp()
    try:
        return datetime.fromisoformat(raw).timestamp()
    except ValueError:
        pass
    raise ValueError(f"--since {text!r} is neither a duration (10m, 90s, 2h, 1d), a time "
                     "(23:40, 2026-11-25T23:40:07) nor unix seconds (@1764114000)")
