"""The monitor's HTTP server: the page, its JSON, ``/metrics``; read-only, optionally behind auth.

Routes (GET and HEAD only; anything else is refused with 405):

=========================  ========================================================================
``/``                      the page (``static/index.html``; its script and style from ``/static/``)
``/api/runs``              the runs at a glance, the store, the store server's numbers (if any)
``/api/run/<id>?since=N``  one run's status and its events from sequence number ``N`` on
``/metrics``               Prometheus' text exposition (:mod:`._prometheus`)
=========================  ========================================================================

With a shared secret every request needs HTTP Basic credentials whose password is the secret
(any user name), compared in constant time; without them the answer is 401, which makes a
browser ask for them. Nothing secret travels in a URL. Without one, on a loopback address, only
requests whose ``Host`` names this machine (localhost, 127.0.0.1, [::1], the bound address) are
answered (421 otherwise): a web page elsewhere cannot reach the port through a DNS name rebound
to 127.0.0.1. Only runs of :meth:`RunSource.run_ids` are answered (404 otherwise); an idle
connection is closed after :data:`IDLE_TIMEOUT_S`, and at most :data:`MAX_CONNECTIONS` are
served at once (more are closed at once).
"""

from __future__ import annotations

import base64
import binascii
import errno
import hmac
import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ._prometheus import MonitorCollector, render_metrics, require_prometheus
from .._address import is_loopback, port_taken
from ..errors import SourceUnavailable
from ._source import RunSource, run_payload, runs_payload

log = logging.getLogger(__name__)

STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}
IDLE_TIMEOUT_S = 30.0
"""Seconds a connection may stay silent (keep-alive included) before it is closed."""
MAX_CONNECTIONS = 64
"""Connections served at once (each holds a thread); more are closed when accepted."""
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
SECURITY_HEADERS = {
    # Everything comes from this server: no script, style, font or image from another host.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class MonitorServer:
    """The web view and ``/metrics`` of a :class:`RunSource`, served from a thread.

    ``secret``: the password every request must bring (HTTP Basic auth); None: no auth. Port 0
    picks a free port (see :attr:`port`). Needs ``prometheus_client`` (``rdzv[monitor]``).
    """

    def __init__(self, source: RunSource, host: str, port: int = 0, *,
                 secret: bytes | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        require_prometheus()
        self.source = source
        self.collector = MonitorCollector(source)
        self.secret = secret
        self.idle_timeout_s = idle_timeout_s
        try:
            self._httpd = _HTTPServer((host, port), _Handler, self, max_connections)
        except OSError as exc:
            taken = port_taken(port) if exc.errno == errno.EADDRINUSE else ""
            raise OSError(exc.errno, f"cannot serve the web view on {host}:{port}: "
                                     f"{exc.strerror}{taken}") from None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = str(self._httpd.server_address[0])
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{f'[{shown}]' if ':' in shown else shown}:{self.port}/"

    def start(self) -> "MonitorServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="rdzv-monitor",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self.source.close()

    def __enter__(self) -> "MonitorServer":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def authorized(self, header: str | None) -> bool:
        """Whether the ``Authorization`` header ``header`` carries the secret (or none is set)."""
        if self.secret is None:
            return True
        scheme, _, encoded = (header or "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            _, _, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        return hmac.compare_digest(password, self.secret)

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request with ``Host: header`` is answered: always with a secret or on a
        non-loopback address; else only for a name of this machine (DNS rebinding)."""
        bound = str(self._httpd.server_address[0])
        if self.secret is not None or not is_loopback(bound):
            return True
        return host_names_this_machine(header, bound, self.port)


def host_names_this_machine(header: str | None, bound: str, port: int) -> bool:
    """Whether the ``Host`` header ``header`` is localhost, 127.0.0.1, [::1] or ``bound``, with
    no port or ``port``."""
    if not header:
        return False
    host = header.strip().lower()
    if host.startswith("["):  # [::1]:8080
        name, _, rest = host[1:].partition("]")
        given = rest[1:] if rest.startswith(":") else None
        if rest and given is None:
            return False
    else:
        name, colon, given_port = host.partition(":")
        given = given_port if colon else None
    if given is not None and given != str(port):
        return False
    return name in LOCAL_NAMES or name == bound.lower()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, monitor: MonitorServer,
                 max_connections: int) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.monitor = monitor
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("web view: %s connections open already: closing one from %s",
                        self.max_connections, client_address[0])
            self.shutdown_request(request)
            return
        try:
            request.settimeout(self.monitor.idle_timeout_s)  # a silent client: closed then
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "rdzv-monitor"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        self._answer(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(send_body=False)

    def _refuse(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"read-only: GET and HEAD only\n",
                   "text/plain; charset=utf-8", extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's signature
        log.debug("%s %s", self.address_string(), format % args)

    def _answer(self, send_body: bool) -> None:
        monitor = self.server.monitor
        if not monitor.host_allowed(self.headers.get("Host")):
            self._send(HTTPStatus.MISDIRECTED_REQUEST, b"this port answers only requests to "
                       b"localhost, 127.0.0.1 or [::1]\n", "text/plain; charset=utf-8",
                       send_body=send_body)
            return
        if not monitor.authorized(self.headers.get("Authorization")):
            self._send(HTTPStatus.UNAUTHORIZED, b"credentials needed: any user name, the "
                       b"store's shared secret as password\n", "text/plain; charset=utf-8",
                       extra={"WWW-Authenticate": 'Basic realm="rdzv", charset="UTF-8"'},
                       send_body=send_body)
            return
        url = urlsplit(self.path)
        path = url.path
        try:
            if path in STATIC:
                name, kind = STATIC[path]
                body = resources.files(__package__).joinpath("static", name).read_bytes()
                self._send(HTTPStatus.OK, body, kind, send_body=send_body)
            elif path == "/metrics":
                body, kind = render_metrics(monitor.collector)
                self._send(HTTPStatus.OK, body, kind, send_body=send_body)
            elif path == "/api/runs":
                self._json(runs_payload(monitor.source), send_body)
            elif path.startswith("/api/run/"):
                run_id = unquote(path[len("/api/run/"):])
                if not monitor.source.has_run(run_id):
                    self._json({"error": f"no run {run_id!r} here"}, send_body,
                               HTTPStatus.NOT_FOUND)
                    return
                since = parse_qs(url.query).get("since", ["0"])[0]
                if not since.isdigit():
                    self._json({"error": f"since must be a sequence number, not {since!r}"},
                               send_body, HTTPStatus.BAD_REQUEST)
                    return
                self._json(run_payload(monitor.source, run_id, int(since)), send_body)
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8",
                           send_body=send_body)
        except SourceUnavailable as exc:
            self._json({"error": str(exc)}, send_body, HTTPStatus.SERVICE_UNAVAILABLE)

    def _json(self, payload: dict[str, Any], send_body: bool,
              status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json",
                   send_body=send_body, extra={"Cache-Control": "no-store"})

    def _send(self, status: HTTPStatus, body: bytes, kind: str, *, send_body: bool = True,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in {**SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)
