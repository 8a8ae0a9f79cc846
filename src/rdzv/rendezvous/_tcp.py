"""The ``tcp`` backend (torch: ``c10d``): dynamic rendezvous on rdzv's TCP store server.

The endpoint ``HOST:PORT`` names the store server. As torch's c10d backend does, the node whose
machine is ``HOST`` hosts the server inside its own process (a master :class:`TCPStore`); the
option ``is_host`` overrides that guess, and when the port is already taken (a standalone
``rdzv serve``, or another node of this machine got there first) a guessed host just connects.
Every other node connects as a client.

Liveness is the client's session: a killed node's connection closes and its ephemeral keys go
at once; a hung node's heartbeats stop and its keys go after ``heartbeat_interval x
heartbeat_misses`` seconds (the session ttl). The hosting node's server lives as long as its
process: ``shutdown()`` leaves the rendezvous but keeps serving the other nodes.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Callable

from .._address import parse_endpoint
from ..errors import StoreConnectionError
from ..kv import auth
from ..store import TCPStore
from ._api import RendezvousParameters
from ._backend import dynamic_handler
from ._engine import DynamicRendezvousHandler
from ._params import backend_spec

logger = logging.getLogger(__name__)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port): a missing port is 29400 and an empty
    endpoint ``localhost:29400``, as torch's c10d backend takes them."""
    return parse_endpoint(endpoint, backend_spec("tcp").default_port)  # type: ignore[union-attr]


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, its hostname, or one of its addresses)."""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", ""):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    try:
        wanted = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
        local: set[str] = set()
        for name in names:
            local |= {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return bool(wanted & local) or any(a.startswith("127.") for a in wanted)


def _address_in_use(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def open_store(params: RendezvousParameters) -> tuple[TCPStore, bool, Callable[[], TCPStore]]:
    """The node's store client, hosting the server if it should.

    Returns (store, whether this node hosts the server, a factory of further clients).
    """
    host, port = split_endpoint(params.endpoint)
    secret = auth.shared_secret(params.get_option("secret_file"))
    options = dict(
        timeout=params.get_option("read_timeout"),
        secret=secret,
        session_ttl=params.session_ttl,
    )
    forced = params.get_option("is_host")
    if forced or (forced is None and is_local_host(host)):
        try:
            store = TCPStore(host, port, is_master=True, **options)
            return store, True, lambda: TCPStore(host, store.port, **options)
        except (OSError, StoreConnectionError) as exc:
            if forced and _address_in_use(exc):
                raise StoreConnectionError(
                    f"this node hosts the store (is_host) but port {port} is taken on it (by "
                    "another program, or the store of another job on this node): give "
                    "--rdzv-endpoint HOST:PORT with a free port") from exc
            if not _address_in_use(exc):
                if isinstance(exc, StoreConnectionError):
                    raise
                raise StoreConnectionError(f"cannot serve the store at {host}:{port}: {exc}") \
                    from exc
            logger.info("rendezvous store %s:%d is served elsewhere: connecting", host, port)
    return TCPStore(host, port, **options), False, lambda: TCPStore(host, port, **options)


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    store, hosting, another_client = open_store(params)
    return dynamic_handler(
        store, params, on_shutdown=None if hosting else store.close, query_store=another_client
    )
