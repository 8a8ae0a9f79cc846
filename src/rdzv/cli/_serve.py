"""``rdzv serve``: run a store server (the TCPStore backend of a job) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_PORT = 29400

log = logging.getLogger("rdzv.server")


def _positive_size(text: str) -> int:
    """A byte count, with an optional K/M/G suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    scale = units.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale != 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 67108864, 64M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, not {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..monitor import add_web_flag
    from ..server import DEFAULT_MAX_FRAME_SIZE, DEFAULT_MEMORY_BUDGET

    parser = subparsers.add_parser(
        "serve",
        help="run a store server",
        description=(
            "Serve a key-value store to TCPStore clients (the tcp rendezvous backend). With "
            "--data-dir every acknowledged write survives a crash and restart of the server. "
            "Stops cleanly on SIGINT or SIGTERM."
        ),
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port to listen on; 0 picks a free one (default: %(default)s)"
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="directory for the write-ahead log and snapshots (default: keep the data in memory only)",
    )
    parser.add_argument(
        "--fsync",
        choices=("always", "never"),
        default="always",
        help=(
            "with --data-dir: 'always' fsyncs before acknowledging a write (survives a machine "
            "crash), 'never' leaves it to the OS (survives a server crash) (default: %(default)s)"
        ),
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help=(
            "file holding the shared secret clients must prove they know (default: the "
            "RDZV_STORE_SECRET environment variable; neither: no authentication)"
        ),
    )
    parser.add_argument(
        "--max-frame-size",
        type=_positive_size,
        default=DEFAULT_MAX_FRAME_SIZE,
        help="largest request or response in bytes, K/M/G suffixes allowed (default: 64M)",
    )
    parser.add_argument(
        "--memory-budget",
        type=_positive_size,
        default=DEFAULT_MEMORY_BUDGET,
        help=(
            "memory the server may use for itself and the requests and answers it buffers for "
            "its clients, K/M/G suffixes allowed; beyond it the connections holding the most are "
            "dropped with an error (default: 512M)"
        ),
    )
    add_web_flag(parser)
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="log level (default: %(default)s)",
    )
    parser.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    """Run the server in the foreground; the exit status (0 after a signal)."""
    from ..errors import RendezvousError
    from ..server import StoreServer
    from ..kv.auth import SECRET_ENV, shared_secret

    if args.web_secret_file is not None and args.web is None:
        print("rdzv serve: error: --web-secret-file goes with --web", file=sys.stderr)
        return 2
    try:
        secret = shared_secret(args.secret_file)
    except (OSError, ValueError) as exc:
        print(f"rdzv serve: cannot read the secret file: {exc}", file=sys.stderr)
        return 2
    if secret is not None and args.secret_file is None:
        log.info("using the shared secret from $%s", SECRET_ENV)
    monitor = None
    try:
        server = StoreServer(
            args.host,
            args.port,
            secret=secret,
            data_dir=args.data_dir,
            fsync=args.fsync,
            max_frame_size=args.max_frame_size,
            memory_budget=args.memory_budget,
            budget_covers_process=True,  # the process is the server's alone
        )
        if args.web is not None:
            from ..monitor import monitor_store_server

            monitor = monitor_store_server(server, args.web, secret, args.web_secret_file)
        server.serve_forever()
    except (OSError, RendezvousError, ValueError) as exc:
        print(f"rdzv serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if monitor is not None:
            monitor.stop()
    log.info("store server stopped")
    return 0

