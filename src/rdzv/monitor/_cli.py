"""The ``--web [HOST:]PORT`` flag of ``rdzv serve`` and ``rdzv status``.

``rdzv serve --web`` shows every run kept in that server, reads them through a client of the
server on loopback, and adds the server's own numbers to ``/metrics``. ``rdzv status URL --web``
shows the one run of the URL, read through its backend's store as ``rdzv status`` reads it
(tcp, etcd, file). Either way the page asks for a password (HTTP Basic auth): the secret of
``--web-secret-file``, else the store's shared secret (``--secret-file`` / ``secret_file=`` /
``$RDZV_STORE_SECRET``, as the store itself resolves it); without either the page is served only
on a loopback address.
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import TYPE_CHECKING, Any

from .._address import is_loopback, parse_endpoint
from ..errors import RendezvousParameterError

if TYPE_CHECKING:  # (imported when the flag is used: the command line starts fast)
    from ..rendezvous import RendezvousParameters
    from ..server import StoreServer
    from ._http import MonitorServer

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
"""Where the web view listens unless told: this machine only."""

WEB_HELP = (
    "also serve a live web view of the run(s) and Prometheus metrics at /metrics on [HOST:]PORT "
    f"(the host defaults to {DEFAULT_HOST}: this machine only; 0.0.0.0 for every interface). "
    "With a shared secret (the store's, or --web-secret-file) the page asks for it as the "
    "password (HTTP Basic auth); without one only a loopback host is allowed. "
    "Needs the rdzv[monitor] extra"
)
WEB_SECRET_HELP = (
    "with --web: a file holding the page's password (HTTP Basic auth, any user name); default: "
    "the store's shared secret (tcp: --secret-file / secret_file= / $RDZV_STORE_SECRET). Needed "
    "for a --web host other than loopback when the store has no secret (etcd, file backends)"
)


def page_secret(address: tuple[str, int], store_secret: bytes | None,
                web_secret_file: str | None) -> bytes | None:
    """The page's password: the secret in ``web_secret_file`` if given, else the store's; an
    error if neither and the page would listen beyond this machine."""
    from ..kv.auth import read_secret_file

    if web_secret_file is not None:
        try:
            return read_secret_file(web_secret_file)
        except (OSError, ValueError) as exc:
            raise RendezvousParameterError(f"--web-secret-file: {exc}") from exc
    if store_secret is None and not is_loopback(address[0]):
        raise RendezvousParameterError(
            f"--web {address[0]}:{address[1]} would serve the page and /metrics to the network "
            "with no password: give the page one with --web-secret-file PATH (or the store a "
            "shared secret: $RDZV_STORE_SECRET, --secret-file), or listen on 127.0.0.1 (the "
            "default) and reach it through an SSH tunnel")
    return store_secret


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
    parser.add_argument("--web-secret-file", default=None, metavar="PATH", help=WEB_SECRET_HELP)


def monitor_store_server(server: "StoreServer", address: tuple[str, int],
                         secret: bytes | None,
                         web_secret_file: str | None = None) -> "MonitorServer":
    """A started monitor of the runs in ``server`` (which may not be listening yet); ``secret``:
    the server's, the page's password unless ``web_secret_file`` gives another."""
    from ..store import TCPStore
    from ._http import MonitorServer
    from ._source import RunSource, server_runs

    def open_store() -> Any:
        host = server.host if server.host not in (None, "", "0.0.0.0", "::") else "127.0.0.1"
        return TCPStore(host, server.port, timeout=5.0, secret=secret)  # type: ignore[arg-type]

    password = page_secret(address, secret, web_secret_file)
    source = RunSource(open_store, runs=server_runs(server.directories),
                       server_metrics=server.metrics, where="this store server")
    return _started(MonitorServer(source, *address, secret=password))


def monitor_run(params: "RendezvousParameters", address: tuple[str, int],
                web_secret_file: str | None = None) -> "MonitorServer":
    """A started monitor of the run of ``params``, guarded by the secret of ``web_secret_file``,
    else by its store's shared secret, resolved as the store client does (tcp: ``secret_file=``,
    else ``$RDZV_STORE_SECRET``)."""
    from ..rendezvous import canonical_backend, open_store
    from ..kv.auth import shared_secret
    from ._http import MonitorServer
    from ._source import RunSource

    store_secret = None
    if canonical_backend(params.backend) == "tcp":
        store_secret = shared_secret(params.get_option("secret_file"))
    password = page_secret(address, store_secret, web_secret_file)
    source = RunSource(lambda: open_store(params), run_id=params.run_id,
                       where=f"{params.backend} {params.endpoint}")
    return _started(MonitorServer(source, *address, secret=password))


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
             " (HTTP Basic auth: any user, the secret as password)" if monitor.secret else "")
    return monitor
