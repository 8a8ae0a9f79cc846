"""Host names, ports and ``HOST:PORT`` endpoints: parsed and checked once, with torch's rules.

Pure functions (no name resolution): a malformed value fails at once with a message that names
it (torch's words first) and shows a valid one. A well-formed name that does not resolve yet is
left to the connection, which keeps retrying (a new pod's DNS name may take a while to appear).
"""

from __future__ import annotations

import ipaddress
import re

from .errors import RendezvousParameterError

DEFAULT_HOST = "localhost"
"""The host of an empty endpoint (torch's ``parse_rendezvous_endpoint``)."""

_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?")
"""A host name: dot-separated labels of letters, digits, ``-`` and ``_`` (torch accepts ``_``),
with an optional final dot (a fully qualified name)."""
_PORT = re.compile(r"[0-9]{1,5}")


def is_host(host: str) -> bool:
    """Whether ``host`` is a well-formed host name, IPv4 or IPv6 address (without brackets)."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return False
        return True
    return bool(_HOST_NAME.fullmatch(host)) and ".." not in host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: object, what: str = "host name") -> str:
    """``host`` if it is a well-formed host name or address, else ValueError saying so."""
    if not isinstance(host, str):
        raise TypeError(f"the {what} must be a str, not {type(host).__name__}")
    if not is_host(host):
        raise RendezvousParameterError(
            f"The {what} {host!r} must be a dot-separated list of labels, an IPv4 address, or an "
            "IPv6 address, e.g. 'node-0.cluster.local', '10.0.0.1' or '::1'."
        )
    return host


def check_port(port: object, what: str = "port", allow_zero: bool = True) -> int:
    """``port`` as an int in 0..65535 (1..65535 unless ``allow_zero``), else ValueError/TypeError."""
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"the {what} must be an int, not {type(port).__name__}")
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise RendezvousParameterError(
            f"The {what} must be an integer between {low} and 65535, got {port}."
        )
    return port


def parse_endpoint(endpoint: str | None, default_port: int | None) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``[IPV6]`` or ``[IPV6]:PORT`` as ``(host, port)``.

    As torch's ``parse_rendezvous_endpoint``: an empty endpoint is ``localhost`` and the default
    port, a missing port is the default port (``default_port=None``: a port is required), and
    ``host:`` (an empty port) is an error. A bare IPv6 address (``::1``) is a host.

    Raises:
        RendezvousParameterError: the endpoint is malformed (the message names it).
    """
    text = (endpoint or "").strip()
    if not text and default_port is not None:
        return DEFAULT_HOST, default_port
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise _endpoint_error(text, "host")
        port: str | None = rest[1:] if rest else None
        if not host or ":" not in host:
            raise _endpoint_error(text, "host")
    elif text.count(":") > 1:
        host, port = text, None  # a bare IPv6 address
    else:
        host, colon, port_text = text.partition(":")
        port = port_text if colon else None
    if port is None:
        if default_port is None:
            raise _endpoint_error(text, "port")
        number = default_port
    elif not _PORT.fullmatch(port) or int(port) > 65535:
        raise _endpoint_error(text, "port")
    else:
        number = int(port)
    if not is_host(host):
        raise _endpoint_error(text, "host")
    return host, number


def _endpoint_error(endpoint: str, part: str) -> RendezvousParameterError:
    if part == "port":
        problem = (
            f"The port number of the rendezvous endpoint '{endpoint}' must be an integer between "
            "0 and 65536."
        )
    else:
        problem = (
            f"The hostname of the rendezvous endpoint '{endpoint}' must be a dot-separated list "
            "of labels, an IPv4 address, or an IPv6 address."
        )
    return RendezvousParameterError(
        f"{problem} Give HOST:PORT, e.g. '10.0.0.1:29400', 'node-0:29400' or '[::1]:29400'."
    )


def port_taken(port: int) -> str:
    """What to add to an "Address already in use" error about ``port``."""
    return (f": another process listens on port {port} (`ss -ltnp 'sport = :{port}'` names it): "
            "stop it, or give another port")
