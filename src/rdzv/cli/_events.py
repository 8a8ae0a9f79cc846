"""``rdzv status --events``: a run's history as a timeline or JSON lines, once or followed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..errors import RendezvousError
from ..rendezvous._history import RunEvent, events_dir, read_events
from ..rendezvous._layout import RunKeys
from ..rendezvous._timeline import format_event, parse_since
from ..store import Store

USAGE_ERROR = 2
FOLLOW_POLL = 0.5
"""Seconds between reads of the history with --follow (a write wakes the reader sooner)."""
SETTLE = 0.5
"""With --follow, events younger than this wait for the next read: one written a little late
(a background writer, another host's clock) is not skipped."""


def events_command(args: argparse.Namespace, store: Store, run_id: str) -> int:
    """Print the history of ``run_id`` (the store is closed by the caller)."""
    try:
        since_time = parse_since(args.since, time.time()) if args.since is not None else None
    except ValueError as exc:
        print(f"rdzv status: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    keys = RunKeys(run_id)
    reported: set[str] = set()
    printed = 0
    next_seq = int(since_time * 1e6) if since_time is not None else 0
    try:
        while True:
            revision = store.revision(events_dir(keys)) if args.follow else 0
            closed = args.follow and store.try_get(keys.closed) is not None
            # Once the run is closed the last events are read whole: nothing settles later.
            log = read_events(store, run_id, since_seq=next_seq,
                              settle_s=SETTLE if args.follow and not closed else 0.0)
            for message in log.corrupt:
                if message not in reported:
                    reported.add(message)
                    print(f"rdzv status: skipped a corrupt event: {message}", file=sys.stderr)
            for event in log.events:
                if since_time is None or event.time >= since_time:
                    _print(event, args.json)
                    printed += 1
            next_seq = log.next_seq
            if not args.follow:
                if printed == 0 and not args.json:
                    print(f"run {run_id}: no events" + (" in that time" if args.since else ""))
                return 0
            if closed:
                return 0
            if store.try_get(keys.closed) is not None:
                time.sleep(SETTLE)  # its last events (run_closed) are on their way
                continue
            if store.watch(events_dir(keys), revision, FOLLOW_POLL) > revision:
                time.sleep(SETTLE)  # read what was written once it has settled
    except KeyboardInterrupt:
        return 0
    except RendezvousError as exc:
        print(f"rdzv status: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _print(event: RunEvent, as_json: bool) -> None:
    line: Any = json.dumps(event.to_json()) if as_json else format_event(event)
    print(line, flush=True)
