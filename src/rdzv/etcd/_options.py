"""How to reach etcd: endpoints, TLS, credentials and timeouts, parsed from strings and configs.

``EtcdOptions.from_config("h1:2379,h2:2379", {"protocol": "https", "ca_cert": ...})`` accepts
the option names of torch's etcd rendezvous backends (``ssl_cert``/``cert``,
``ssl_cert_key``/``key``, ``ca_cert``/``cacert``) and rejects bad values with a message that
says which option is wrong and how to fix it.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from .._address import parse_endpoint
from ..errors import RendezvousParameterError

DEFAULT_PORT = 2379

_ALIASES = {
    "cert": "ssl_cert",
    "key": "ssl_cert_key",
    "cacert": "ca_cert",
    "username": "user",
}


_OPTION_NAMES = {
    "protocol", "ssl_cert", "ssl_cert_key", "ca_cert", "user", "password",
    "request_timeout", "retry_timeout",
}  # fmt: skip


def parse_endpoints(
    spec: Union[str, Sequence[str]], protocol: str | None = None
) -> tuple[str, tuple[str, ...]]:
    """``(protocol, ("host:port", ...))`` from ``"h1:2379,https://h2"`` or a list of such strings.

    A missing port means 2379; a missing scheme means ``protocol`` (default ``http``). Every
    endpoint must use the same scheme.
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    schemes: set[str] = set()
    endpoints: list[str] = []
    for raw in items:
        item = raw.strip().rstrip("/")
        if not item:
            if len(items) > 1:
                raise ValueError(f"etcd endpoints {spec!r} list an empty endpoint (no host): "
                                 "remove the extra comma")
            continue
        scheme, sep, rest = item.partition("://")
        if sep:
            if scheme not in ("http", "https"):
                raise ValueError(
                    f"etcd endpoint {raw!r}: scheme must be http or https, not {scheme!r}"
                )
            schemes.add(scheme)
        else:
            rest = item
        endpoints.append(_host_port(raw, rest))
    if not endpoints:
        raise ValueError(f"no etcd endpoint given in {spec!r}: expected e.g. '127.0.0.1:2379'")
    if protocol is not None:
        if protocol not in ("http", "https"):
            raise ValueError(f"etcd protocol must be 'http' or 'https', not {protocol!r}")
        schemes.add(protocol)
    if len(schemes) > 1:
        raise ValueError(f"etcd endpoints {spec!r} mix http and https: use one protocol for all")
    return (schemes.pop() if schemes else "http"), tuple(endpoints)


def _host_port(raw: str, rest: str) -> str:
    if "/" in rest:
        raise ValueError(f"etcd endpoint {raw!r} has a path: give only host[:port]")
    if not rest.strip():
        raise ValueError(f"etcd endpoint {raw!r} has no host")
    try:
        host, port = parse_endpoint(rest, DEFAULT_PORT)
    except RendezvousParameterError as exc:
        raise ValueError(f"etcd endpoint {raw!r}: {exc}") from None
    if not port:
        raise ValueError(f"etcd endpoint {raw!r}: port 0 is not a number in 1..65535")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class EtcdOptions:
    """Everything an etcd client needs besides the key prefix."""

    endpoints: tuple[str, ...]
    """``host:port`` of each cluster member; requests fail over between them."""
    protocol: str = "http"
    ssl_cert: str | None = None
    """Client certificate (PEM) presented to etcd over https."""
    ssl_cert_key: str | None = None
    """The private key of ``ssl_cert`` (PEM)."""
    ca_cert: str | None = None
    """CA bundle that signed etcd's certificate (default: the system's)."""
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    request_timeout: float = 10.0
    """Seconds one request may take on one endpoint before it is tried on the next."""
    retry_timeout: float = 60.0
    """Seconds to keep retrying across endpoints while the cluster is unreachable or leaderless."""

    def __post_init__(self) -> None:
        if self.protocol not in ("http", "https"):
            raise ValueError(f"etcd protocol must be 'http' or 'https', not {self.protocol!r}")
        for name in ("ssl_cert", "ssl_cert_key", "ca_cert"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"etcd option {name}={path!r}: no such file")
        if (self.ssl_cert is None) != (self.ssl_cert_key is None):
            raise ValueError("etcd options ssl_cert and ssl_cert_key must be given together")
        if self.protocol == "http" and (self.ssl_cert or self.ca_cert):
            raise ValueError("etcd TLS files were given but protocol is http: set protocol=https")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd options user and password must be given together")
        for name in ("request_timeout", "retry_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"etcd option {name} must be > 0, got {getattr(self, name)!r}")

    @classmethod
    def from_config(
        cls,
        endpoints: Union[str, Sequence[str]],
        config: Mapping[str, Any] | None = None,
        *,
        strict: bool = False,
    ) -> "EtcdOptions":
        """Options from an endpoint list and a config mapping.

        Keys that are no etcd option are ignored (a rendezvous config holds others too), or
        rejected with ``strict``.
        """
        values = {_ALIASES.get(k, k): v for k, v in (config or {}).items()}
        unknown = sorted(set(values) - _OPTION_NAMES)
        if strict and unknown:
            raise TypeError(
                f"unknown etcd option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_OPTION_NAMES))}"
            )
        protocol, parsed = parse_endpoints(endpoints, values.get("protocol"))
        kwargs: dict[str, Any] = {"endpoints": parsed, "protocol": protocol}
        for name in ("ssl_cert", "ssl_cert_key", "ca_cert", "user", "password"):
            if values.get(name) not in (None, ""):
                kwargs[name] = str(values[name])
        for name in ("request_timeout", "retry_timeout"):
            if values.get(name) not in (None, ""):
                try:
                    kwargs[name] = float(values[name])
                except (TypeError, ValueError):
                    raise ValueError(
                        f"etcd option {name}={values[name]!r} is not a number of seconds"
                    ) from None
        return cls(**kwargs)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client SSL context for https (None for http)."""
        if self.protocol != "https":
            return None
        context = ssl.create_default_context(cafile=self.ca_cert)
        if self.ssl_cert and self.ssl_cert_key:
            context.load_cert_chain(self.ssl_cert, self.ssl_cert_key)
        return context
