"""``rdzv status``: a run at a glance (round, members, liveness, waiting nodes), once or live;
with ``--events`` its history (a timeline or JSON lines), once or followed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..rendezvous import RunEvent
    from ..store import Store

USAGE_ERROR = 2
FOLLOW_POLL = 0.5
"""Seconds between reads of the history with --follow (a write wakes the reader sooner)."""
SETTLE = 0.5
"""With --follow, how long to let a burst of writes land before reading (and to wait for a
closed run's last events); an event written later still comes with a later read."""


def register(subparsers: Any) -> None:
    """Add the ``status`` sub-command."""
    from ..monitor import add_web_flag

    parser = subparsers.add_parser(
        "status",
        help="show the state of a run: round, members, waiting nodes",
        description="Show a run at a glance, read from its rendezvous store. Give the run as "
                    "a rendezvous URL (tcp://HOST:PORT/RUN_ID, file:///DIR/RUN_ID) or with "
                    "--rdzv-backend/--rdzv-endpoint/--rdzv-id as for rdzv run.",
        allow_abbrev=False,
    )
    parser.add_argument("url", nargs="?", help="the run's rendezvous URL")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", default="tcp")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="")
    parser.add_argument("--rdzv-id", "--rdzv_id", default=None)
    parser.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                        help="backend options as key=value,... (e.g. secret_file=PATH)")
    parser.add_argument("--json", action="store_true", help="print JSON (one object a line)")
    parser.add_argument("--watch", action="store_true",
                        help="print again whenever the run changes (Ctrl-C stops)")
    parser.add_argument("--interval", type=float, default=2.0,
                        help="with --watch: print at least this often (seconds)")
    parser.add_argument("--count", type=int, default=0,
                        help="with --watch: stop after this many reports (0: never)")
    parser.add_argument("--events", action="store_true",
                        help="print the run's history: a timeline of its rounds, joins, leaves, "
                             "losses and worker failures (with --json: JSON lines)")
    parser.add_argument("--since", default=None, metavar="WHEN",
                        help="with --events: only events after WHEN, a duration back from now "
                             "(10m, 90s, 2h) or a time (23:40, 2026-11-25T23:40:07)")
    parser.add_argument("--follow", action="store_true",
                        help="with --events: keep printing new events until the run closes "
                             "(or Ctrl-C)")
    add_web_flag(parser)
    parser.set_defaults(func=status_command, log_level="WARNING")


STORE_TIMEOUT = "5"
"""Seconds ``rdzv status`` tries to reach (and read) the store, unless read_timeout is given:
a store that is gone (the job ended with the node that hosted it) is said within this."""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _parameters(args: argparse.Namespace) -> Any:
    from ..agent import ConfigError, parse_rdzv_conf
    from ..rendezvous import RendezvousParameters, canonical_backend, parse_rendezvous_url

    if args.url:
        if args.rdzv_id or args.rdzv_endpoint or args.rdzv_conf:
            raise ValueError("give the run either as a URL (options in its query, e.g. "
                             "?read_timeout=5) or with --rdzv-* flags, not both")
        url = args.url
        if not any(f"{name}=" in url for name in ("nnodes", "min_nodes", "world_size")):
            url += ("&" if "?" in url else "?") + "nnodes=1"  # node counts do not matter here
        if "read_timeout=" not in url:
            url += f"&read_timeout={STORE_TIMEOUT}"
        return parse_rendezvous_url(url)
    if not args.rdzv_id:
        raise ValueError("which run? give its URL (e.g. tcp://HOST:29400/RUN_ID) or --rdzv-id "
                         "with --rdzv-backend and --rdzv-endpoint")
    try:
        conf = parse_rdzv_conf(args.rdzv_conf)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    backend = canonical_backend(args.rdzv_backend)
    conf.setdefault("read_timeout", STORE_TIMEOUT)
    return RendezvousParameters(backend, args.rdzv_endpoint, args.rdzv_id, 1, 1, **conf)


def status_command(args: argparse.Namespace) -> int:
    from ..errors import RendezvousError
    from .._patience import notice_if_slow
    from ..rendezvous import (
        RunKeys,
        format_status,
        open_store,
        parse_since,
        read_status,
        unknown_run,
    )

    if args.interval <= 0 or args.count < 0:
        print("rdzv status: error: --interval must be > 0 and --count >= 0", file=sys.stderr)
        return USAGE_ERROR
    if (args.since is not None or args.follow) and not args.events:
        print("rdzv status: error: --since and --follow go with --events", file=sys.stderr)
        return USAGE_ERROR
    if args.events and args.watch:
        print("rdzv status: error: --events takes --follow, not --watch", file=sys.stderr)
        return USAGE_ERROR
    if args.web_secret_file is not None and args.web is None:
        print("rdzv status: error: --web-secret-file goes with --web", file=sys.stderr)
        return USAGE_ERROR
    try:
        params = _parameters(args)
        if args.since is not None:
            parse_since(args.since, time.time())
    except ValueError as exc:
        print(f"rdzv status: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        how = (f": up to {params.get_option('read_timeout'):g} s (read_timeout=SECONDS in the "
               "URL's query or --rdzv-conf)")
    except KeyError:  # a backend without that option
        how = ""
    try:
        with notice_if_slow(_say, f"rdzv status: reaching the store of run {params.run_id!r} "
                                  f"({params.backend} {params.endpoint}){how}"):
            store = open_store(params)
    except (RendezvousError, OSError) as exc:
        print(f"rdzv status: cannot open the store of run {params.run_id!r} "
              f"({params.backend} {params.endpoint}): {exc}\n  likely: the run has ended and "
              "its store went with the node that hosted it (is_host); or a wrong endpoint; or "
              "the store is down\n  to do: check the endpoint; a store the nodes outlive (`rdzv "
              "serve`, etcd) keeps a run's state and history after it ends; "
              "?read_timeout=SECONDS waits longer", file=sys.stderr)
        return 1
    if args.web is not None:
        return _serve_web(params, args.web, args.web_secret_file, store)
    if not args.watch and not args.follow:  # (a run watched may be about to start)
        try:
            unknown = unknown_run(store, params.run_id)
        except RendezvousError as exc:
            print(f"rdzv status: cannot read the store of run {params.run_id!r} "
                  f"({params.backend} {params.endpoint}): {exc}", file=sys.stderr)
            return 1
        if unknown is not None:
            print(f"rdzv status: error: {unknown}", file=sys.stderr)
            return 1
    if args.events:
        return events_command(args, store, params.run_id)
    base = RunKeys(params.run_id).base
    reports = 0
    shown: dict[str, Any] | None = None
    printed_at = 0.0
    try:
        while True:
            since = store.revision(base)
            status = read_status(store, params.run_id)
            shape = status.without_ages()
            # --watch prints when the run changed (a write that changes nothing shown does not
            # count), and at least every --interval seconds.
            if shape != shown or time.monotonic() - printed_at >= args.interval:
                if args.json:
                    print(json.dumps(status.as_dict()), flush=True)
                else:
                    stamp = f"[{time.strftime('%H:%M:%S')}] " if args.watch else ""
                    print(stamp + format_status(status), flush=True)
                shown, printed_at = shape, time.monotonic()
                reports += 1
                if not args.watch or (args.count and reports >= args.count):
                    return 0
            remaining = printed_at + args.interval - time.monotonic()
            store.watch(base, since, max(0.0, remaining))
    except KeyboardInterrupt:
        return 0
    except RendezvousError as exc:
        print(f"rdzv status: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()


def events_command(args: argparse.Namespace, store: "Store", run_id: str) -> int:
    """``--events``: print the history of ``run_id`` as a timeline or JSON lines, once or
    followed (the store is closed by the caller)."""
    from ..errors import RendezvousError
    from ..rendezvous import EventLog, RunKeys, events_dir, parse_since, read_events

    try:
        since_time = parse_since(args.since, time.time()) if args.since is not None else None
    except ValueError as exc:
        print(f"rdzv status: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    keys = RunKeys(run_id)
    reported: set[str] = set()
    printed = 0
    seen_closed = False
    log: EventLog | None = None
    try:
        while True:
            revision = store.revision(events_dir(keys)) if args.follow else 0
            closed = args.follow and store.try_get(keys.closed) is not None
            # The events not printed yet, by key: however late a write lands, it comes.
            log = read_events(store, run_id, after=log)
            for message in log.corrupt:
                if message not in reported:
                    reported.add(message)
                    print(f"rdzv status: skipped a corrupt event: {message}", file=sys.stderr)
            for event in log.events:
                if since_time is None or event.time >= since_time:
                    _print(event, args.json)
                    printed += 1
            if not args.follow:
                if printed == 0 and not args.json:
                    print(f"run {run_id}: no events" + (" in that time" if args.since else ""))
                return 0
            if closed:
                return 0
            if store.try_get(keys.closed) is not None:
                seen_closed = True
                time.sleep(SETTLE)  # its last events (run_closed) are on their way
                continue
            if store.watch(events_dir(keys), revision, FOLLOW_POLL) > revision:
                time.sleep(SETTLE)  # read what was written once it has settled
    except KeyboardInterrupt:
        return 0
    except RendezvousError as exc:
        if seen_closed:  # the run ended and its store went with it (a node served it)
            print(f"rdzv status: the run's store went away after it closed ({exc})",
                  file=sys.stderr)
            return 0
        print(f"rdzv status: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _print(event: "RunEvent", as_json: bool) -> None:
    from ..rendezvous import format_event

    print(json.dumps(event.to_json()) if as_json else format_event(event), flush=True)


def _serve_web(params: Any, address: tuple[str, int], web_secret_file: str | None,
               store: Any) -> int:
    """``--web``: serve the run's live page and /metrics until Ctrl-C."""
    from ..errors import RendezvousError, RendezvousParameterError
    from ..monitor import monitor_run, serve_until_interrupted

    store.close()  # (opened to check the run's store is reachable; the view opens its own)
    try:
        monitor = monitor_run(params, address, web_secret_file)
    except RendezvousParameterError as exc:
        print(f"rdzv status: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except (RendezvousError, OSError, ValueError) as exc:
        print(f"rdzv status: --web: {exc}", file=sys.stderr)
        return 1
    print(f"rdzv status: the live view of run {params.run_id!r} is at {monitor.url} "
          "(Ctrl-C stops)", flush=True)
    return serve_until_interrupted(monitor)
