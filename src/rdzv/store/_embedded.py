"""A master TCPStore's embedded server, shared per port with ``multi_tenant=True``, and the checks
of TCPStore's constructor arguments.

As torch's ``TCPStore(..., is_master=True, multi_tenant=True)``: every multi-tenant master of
one port in a process uses one server, started by the first and stopped when the last is closed
or collected. A master without ``multi_tenant`` starts a server of its own (a second one on a
taken port fails with "address already in use", as torch's does).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import TYPE_CHECKING

from .._address import check_host, check_port

if TYPE_CHECKING:
    from ..server import StoreServer

log = logging.getLogger("rdzv.store.tcp")


def check_arguments(
    host_name: object,
    port: object,
    world_size: object,
    is_master: bool,
    master_listen_fd: object,
) -> tuple[str, int, int | None]:
    """TCPStore's arguments checked at once: ``(host_name, port, world_size)`` (world size
    None when not given or -1, torch's "unknown").

    Raises:
        ValueError, TypeError: an argument is malformed (the message names it).
    """
    host = check_host(host_name, "TCPStore host name")
    number = check_port(port, "TCPStore port")
    if number == 0 and not is_master and master_listen_fd is None:
        raise ValueError(
            "TCPStore port 0 picks a free port for a master (is_master=True); a client must "
            "be given the port its master listens on"
        )
    if master_listen_fd is not None and (
        isinstance(master_listen_fd, bool) or not isinstance(master_listen_fd, int)
        or master_listen_fd < 0
    ):
        raise ValueError(f"master_listen_fd must be a file descriptor (int >= 0), got {master_listen_fd!r}")
    if world_size is None or world_size == -1:
        return host, number, None
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"TCPStore world size must be an int, not {type(world_size).__name__}")
    if world_size == 0:
        raise ValueError("TCPStore world size cannot be 0 (give the number of clients, or None)")
    if world_size < 0:
        raise ValueError(f"TCPStore world size must be positive or -1 (unknown), got {world_size}")
    return host, number, world_size


class _Shared:
    """A multi-tenant server and how many master stores use it."""

    def __init__(self, server: "StoreServer") -> None:
        self.server = server
        self.users = 0


_lock = threading.Lock()
_shared: dict[int, _Shared] = {}
"""The multi-tenant servers of this process, by port."""


def start_server(
    bind_host: str, port: int, secret: bytes | None, listen_fd: int | None, multi_tenant: bool
) -> "StoreServer":
    """A started server for a master store: the shared one of ``port`` if ``multi_tenant`` and
    this process has one, else a new one (shared from now on if ``multi_tenant``). Give it back
    with :func:`stop_server`."""
    from ..server import StoreServer

    with _lock:
        shared = _shared.get(port) if multi_tenant and port else None
        if shared is None:
            sock = socket.socket(fileno=listen_fd) if listen_fd is not None else None
            server = StoreServer(bind_host, port, secret=secret, sock=sock).start()
            if not multi_tenant:
                return server
            shared = _shared[server.port] = _Shared(server)
        else:
            log.debug("TCPStore master shares the server on port %d (multi_tenant)", port)
        shared.users += 1
        return shared.server


def stop_server(server: "StoreServer") -> None:
    """A master store is done with ``server``: stop it, unless other multi-tenant masters use it."""
    with _lock:
        shared = _shared.get(server.port)
        if shared is not None and shared.server is server:
            shared.users -= 1
            if shared.users > 0:
                return
            del _shared[server.port]
    server.stop()
