"""The ``--web [HOST:]PORT`` flag of ``rdzv serve`` and ``rdzv status``.

``rdzv serve --web`` shows every run kept in that server, reads them through a client of the
server on loopback, and adds the server's own numbers to ``/metrics``. ``rdzv status URL --web``
shows the one run of the URL, read through its backend's store as ``rdzv status`` reads it
(tcp, etcd, file). Either way the page asks for the store's shared secret as a password when
the store has one.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import TYPE_CHECKING, Any

from .._address import parse_endpoint
from ..errors import RendezvousParameterError

if TYPE_CHECKING:  # (imported when the flag is used: the command line starts fast)
    from ..rendezvous import RendezvousParameters
    from ..server import StoreServer
    from ._http import MonitorServer

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"

WEB_HELP = (
    "also serve a live web view of the run(s) and Prometheus metrics at /metrics on [HOST:]PORT "
    f"(the host defaults to {DEFAULT_HOST}: this machine only; 0.0.0.0 for every interface). "
    "With a shared secret the page asks for it as the password (HTTP Basic auth). "
    "Needs the rdzv[monitor] extra"
)


def parse_web_address(text: str) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (``[IPV6]:PORT``) as (host, port); the host defaults to
    127.0.0.1 (this machine only)."""
    text = text.strip()
    if text.isdigit():
        text = f"{DEFAULT_HOST}:{text}"
    try:
        return parse_endpoint(text, None)
    except RendezvousParameterError:
        raise RendezvousParameterError(
            f"--web takes [HOST:]PORT (e.g. 8080, 0.0.0.0:8080, [::1]:8080), not {text!r}"
        ) from None


def add_web_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--web [HOST:]PORT`` to ``parser`` (parsed into ``args.web`` as (host, port))."""

    def address(text: str) -> tuple[str, int]:
        try:
            return parse_web_address(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument("--web", type=address, default=None, metavar="[HOST:]PORT", help=WEB_HELP)


def monitor_store_server(server: "StoreServer", address: tuple[str, int],
                         secret: bytes | None) -> "MonitorServer":
    """A started monitor of the runs in ``server`` (which may not be listening yet)."""
    from ..store import TCPStore
    from ._http import MonitorServer
    from ._source import RunSource, server_runs

    def open_store() -> Any:
        host = server.host if server.host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
        return TCPStore(host, server.port, timeout=5.0, secret=secret)  # type: ignore[arg-type]

    source = RunSource(open_store, runs=server_runs(server.directories),
                       server_metrics=server.metrics, where="this store server")
    return _started(MonitorServer(source, *address, secret=secret))


def monitor_run(params: "RendezvousParameters", address: tuple[str, int]) -> "MonitorServer":
    """A started monitor of the run of ``params`` (its store's secret, if any, guards it)."""
    from ..rendezvous._status import open_store
    from ..server._auth import read_secret_file
    from ._http import MonitorServer
    from ._source import RunSource

    secret_file = params.get_option("secret_file") if params.backend in ("tcp", "c10d") else None
    source = RunSource(lambda: open_store(params), run_id=params.run_id,
                       where=f"{params.backend} {params.endpoint}")
    secret = read_secret_file(secret_file) if secret_file else None
    return _started(MonitorServer(source, *address, secret=secret))


def serve_until_interrupted(monitor: "MonitorServer") -> int:
    """Keep ``monitor`` serving until Ctrl-C; the exit status."""
    stop = threading.Event()
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        monitor.stop()
    return 0


def _started(monitor: "MonitorServer") -> "MonitorServer":
    monitor.start()
    log.info("web view and /metrics at %s%s", monitor.url,
             " (password: the shared secret)" if monitor.secret else "")
    return monitor
