"""Finding a backend by name: the handler registry, its entry points, and rendezvous URLs.

Built-in backends are registered by module path (``"rdzv.rendezvous._tcp:create_handler"``) and
imported only when a handler is created, so ``import rdzv`` stays fast. Each built-in backend
module defines ``create_handler(params: RendezvousParameters) -> RendezvousHandler``.
Third-party packages add backends through the entry-point group ``rdzv.rendezvous_backends``
(``name = "package.module:create_handler"``), also loaded only when needed.

A rendezvous URL names the backend, endpoint, run id and options in one string, e.g.
``tcp://10.0.0.1:29400/job-42?min_nodes=2&max_nodes=4`` (see ``docs/rendezvous.md``).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any, Callable, Mapping, Union
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from .._address import parse_endpoint
from ..errors import RendezvousBackendError, RendezvousParameterError
from ._api import RendezvousHandler, RendezvousParameters
from ._params import BACKEND_ALIASES, RENAMED_PARAMETERS, backend_spec

logger = logging.getLogger(__name__)

RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]

ENTRY_POINT_GROUP = "rdzv.rendezvous_backends"

_CREATORS = {
    "tcp": "rdzv.rendezvous._tcp:create_handler",
    "file": "rdzv.rendezvous._file:create_handler",
    "memory": "rdzv.rendezvous._memory:create_handler",
    "static": "rdzv.rendezvous._static:create_handler",
    "etcd": "rdzv.rendezvous._etcd:create_handler",
}
BUILTIN_BACKENDS: Mapping[str, str] = {
    **_CREATORS, **{alias: _CREATORS[name] for alias, name in BACKEND_ALIASES.items()}}
"""The backends rdzv ships (and their aliases), by the module path of their handler creator."""

_Entry = Union[RendezvousHandlerCreator, str]


def _reference(creator: RendezvousHandlerCreator) -> str:
    return f"{getattr(creator, '__module__', '?')}:{getattr(creator, '__qualname__', creator)}"


def _import_creator(reference: str, backend: str) -> RendezvousHandlerCreator:
    """Import ``module:attribute``; a ValueError saying the backend is unavailable if it fails."""
    module_name, _, attributes = reference.partition(":")
    try:
        creator: Any = importlib.import_module(module_name.strip())
        for attribute in attributes.strip().split("."):
            creator = getattr(creator, attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RendezvousParameterError(
            f"The rendezvous backend '{backend}' is not available: {reference} could not be "
            f"loaded ({exc}). Check that rdzv (and the backend's extra, e.g. rdzv[etcd]) is "
            f"installed completely."
        ) from exc
    return creator


class RendezvousHandlerRegistry:
    """Backend names and the creators of their handlers (torch's ``RendezvousHandlerRegistry``).

    Args:
        builtins: backends known by module path, imported on first use.
        entry_point_group: an entry-point group searched for backends not registered otherwise.
    """

    def __init__(
        self,
        builtins: Mapping[str, str] | None = None,
        entry_point_group: str | None = None,
    ) -> None:
        self._entries: dict[str, _Entry] = dict(builtins or {})
        self._entry_point_group = entry_point_group
        self._lock = threading.Lock()

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Register ``creator`` as the backend ``backend``.

        Raises:
            ValueError: the name is empty, or already registered with another creator
                (registering the same creator again is allowed).
        """
        if not isinstance(backend, str) or not backend.strip():
            raise RendezvousParameterError("The rendezvous backend name must be a non-empty string.")
        if not callable(creator):
            raise RendezvousParameterError(
                f"The creator of rendezvous backend '{backend}' must be callable as "
                f"creator(params) -> RendezvousHandler, got {creator!r}."
            )
        with self._lock:
            current = self._entries.get(backend)
            same = current is None or current is creator or current == _reference(creator)
            if not same:
                shown = current if isinstance(current, str) else _reference(current)  # type: ignore[arg-type]
                raise RendezvousParameterError(
                    f"The rendezvous backend '{backend}' cannot be registered with "
                    f"{_reference(creator)} as it is already registered with {shown}. "
                    f"Choose another backend name."
                )
            self._entries[backend] = creator

    def known_backends(self) -> list[str]:
        """Every backend name this registry can create, including entry points."""
        names = set(self._entries) | set(self._entry_points())
        return sorted(names)

    def creator(self, backend: str) -> RendezvousHandlerCreator:
        """The creator of ``backend``, importing it if needed; ValueError if unknown."""
        with self._lock:
            entry = self._entries.get(backend)
        if entry is None:
            entry_point = self._entry_points().get(backend)
            if entry_point is None:
                raise RendezvousParameterError(
                    f"The rendezvous backend '{backend}' is not registered. Known backends: "
                    f"{', '.join(self.known_backends()) or 'none'}. Register it with "
                    f"register('{backend}', creator)"
                    + (
                        f" or through the '{self._entry_point_group}' entry-point group."
                        if self._entry_point_group
                        else "."
                    )
                )
            entry = entry_point
        if isinstance(entry, str):
            creator = _import_creator(entry, backend)
            with self._lock:
                if self._entries.get(backend) in (None, entry):
                    self._entries[backend] = creator
            return creator
        return entry

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """A new handler of the backend ``params.backend``."""
        handler = self.creator(params.backend)(params)
        if not isinstance(handler, RendezvousHandler):
            raise TypeError(
                f"The creator of rendezvous backend '{params.backend}' returned "
                f"{type(handler).__name__}, not a RendezvousHandler."
            )
        if handler.get_backend() != params.backend:
            raise RendezvousBackendError(
                f"The rendezvous backend '{handler.get_backend()}' does not match the requested "
                f"backend '{params.backend}'. The creator registered as '{params.backend}' must "
                "return a handler whose get_backend() is that name."
            )
        return handler

    def _entry_points(self) -> dict[str, str]:
        """Backends offered by installed packages: name -> ``module:attribute``."""
        if not self._entry_point_group:
            return {}
        from importlib.metadata import entry_points

        found: dict[str, str] = {}
        for entry_point in entry_points(group=self._entry_point_group):
            if entry_point.name in self._entries:
                continue  # registered here already (built-in, explicit, or this entry point)
            if entry_point.name in found:
                logger.warning(
                    "ignoring entry point %s = %s: another package already offers backend %r",
                    entry_point.name, entry_point.value, entry_point.name,
                )
                continue
            found[entry_point.name] = entry_point.value
        return found


handler_registry = RendezvousHandlerRegistry(BUILTIN_BACKENDS, ENTRY_POINT_GROUP)
"""The default registry, used by :func:`get_rendezvous_handler` and the ``rdzv`` CLI."""


def get_rendezvous_handler(
    params: RendezvousParameters | str,
    registry: RendezvousHandlerRegistry | None = None,
) -> RendezvousHandler:
    """A handler for ``params`` or a rendezvous URL such as ``tcp://host:29400/job?nnodes=2:4``."""
    if isinstance(params, str):
        params = parse_rendezvous_url(params)
    return (registry or handler_registry).create_handler(params)


# -- rendezvous URLs -------------------------------------------------------------------------

_EXAMPLES = {
    "tcp": "tcp://10.0.0.1:29400/job-42?min_nodes=2&max_nodes=4",
    "file": "file:///shared/rdzv/job-42?nnodes=2:4",
    "memory": "memory://job-42?nnodes=2",
    "static": "static://10.0.0.1:29400/job-42?rank=0&world_size=2",
    "etcd": "etcd://10.0.0.1:2379/job-42?nnodes=2:4",
}


def _example(backend: str) -> str:
    return _EXAMPLES.get(backend, f"{backend}://HOST:PORT/RUN_ID?min_nodes=2&max_nodes=4")


def _url_error(url: str, backend: str, problem: str) -> RendezvousParameterError:
    return RendezvousParameterError(
        f"Invalid rendezvous URL {url!r}: {problem}. Example: {_example(backend)}"
    )


def parse_rendezvous_url(url: str) -> RendezvousParameters:
    """The parameters a rendezvous URL describes.

    Forms: ``BACKEND://HOST:PORT/RUN_ID?options`` (tcp, c10d, static, etcd: several
    comma-separated endpoints), ``file:///DIRECTORY/RUN_ID?options`` and ``memory://RUN_ID``.
    The node counts are ``min_nodes`` and ``max_nodes``, or ``nnodes=N`` / ``nnodes=MIN:MAX``
    (static: ``world_size``, else env WORLD_SIZE; etcd also accepts ``min_workers``/``max_workers``).

    Raises:
        ValueError: the URL is malformed; the message says what is wrong and shows an example.
    """
    if not isinstance(url, str) or "://" not in url:
        raise _url_error(str(url), "tcp", "a rendezvous URL has the form BACKEND://ENDPOINT/RUN_ID?OPTIONS")
    backend = url.split("://", 1)[0].lower()
    if not backend or not all(ch.isalnum() or ch in "-_.+" for ch in backend):
        raise _url_error(url, "tcp", f"{backend!r} is not a backend name")
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise _url_error(url, backend, f"cannot be parsed ({exc})") from exc
    if parts.fragment:
        raise _url_error(url, backend, f"unexpected fragment '#{parts.fragment}'")
    endpoint, run_id = _endpoint_and_run_id(url, backend, parts.netloc, unquote(parts.path))
    options: dict[str, Any] = {}
    for key, value in query:
        if key in options:
            raise _url_error(url, backend, f"option '{key}' is given twice")
        options[key] = value
    min_nodes, max_nodes = _node_counts(url, backend, options)
    local_addr = options.pop("local_addr", None)
    return RendezvousParameters(backend, endpoint, run_id, min_nodes, max_nodes, local_addr, **options)


def _endpoint_and_run_id(url: str, backend: str, netloc: str, path: str) -> tuple[str, str]:
    spec = backend_spec(backend)
    kind = spec.endpoint if spec else "host"
    if kind == "none":
        if netloc and path.strip("/"):
            raise _url_error(url, backend, "this backend has no endpoint, only a run id")
        run_id = netloc or path.strip("/")
        endpoint = ""
    elif kind == "path":
        if netloc not in ("", "localhost"):
            raise _url_error(
                url, backend, f"a file URL has three slashes and an absolute directory "
                f"(got host {netloc!r})"
            )
        directory, _, run_id = path.rstrip("/").rpartition("/")
        if not directory:
            raise _url_error(url, backend, "the directory before the run id is missing")
        endpoint = directory
    else:
        run_id = path.strip("/")
        if "/" in run_id:
            raise _url_error(url, backend, f"the run id {run_id!r} must be one path segment")
        endpoint = netloc
        _check_host_ports(url, backend, endpoint)
    if not run_id:
        raise _url_error(url, backend, "the run id is missing")
    return endpoint, run_id


def _check_host_ports(url: str, backend: str, endpoint: str) -> None:
    """Each comma-separated part of ``endpoint`` is HOST, HOST:PORT or [IPV6]:PORT."""
    if not endpoint:
        raise _url_error(url, backend, "the HOST:PORT endpoint is missing")
    for host_port in endpoint.split(","):
        try:
            if not host_port:
                raise RendezvousParameterError("an endpoint in the list is empty")
            if host_port.count(":") > 1 and not host_port.startswith("["):
                raise RendezvousParameterError("an IPv6 address in a URL goes in brackets")
            parse_endpoint(host_port, 0)
        except RendezvousParameterError as exc:
            raise _url_error(url, backend, f"{host_port!r} is not a HOST:PORT endpoint ({exc})") from None


def _node_counts(url: str, backend: str, options: dict[str, Any]) -> tuple[int, int]:
    """Take min/max nodes out of ``options`` (nnodes, legacy names, static's world_size)."""
    for legacy, current in RENAMED_PARAMETERS.items():
        if legacy not in options:
            continue
        if not backend.startswith("etcd"):
            raise _url_error(
                url, backend, f"'{legacy}' is torch's older name of '{current}' (accepted in "
                f"etcd URLs only); use '{current}'"
            )
        if current in options:
            raise _url_error(url, backend, f"give only one of '{legacy}' and '{current}'")
        options[current] = options.pop(legacy)
    counts = {name: options.pop(name) for name in ("min_nodes", "max_nodes") if name in options}
    nnodes = options.pop("nnodes", None)
    if nnodes is not None:
        if counts:
            raise _url_error(url, backend, "give either nnodes or min_nodes/max_nodes, not both")
        low, _, high = nnodes.partition(":")
        counts = {"min_nodes": low, "max_nodes": high or low}
    if backend == "static":
        world_size = options.get("world_size") or os.environ.get("WORLD_SIZE")
        if world_size is not None and not counts:
            counts = {"min_nodes": world_size, "max_nodes": world_size}
        if "world_size" in options and set(counts.values()) != {world_size}:
            raise _url_error(
                url, backend, "a static rendezvous has min_nodes = max_nodes = world_size"
            )
    if set(counts) != {"min_nodes", "max_nodes"}:
        raise _url_error(url, backend, "give the node counts as min_nodes and max_nodes, or nnodes=MIN:MAX")
    try:
        return int(counts["min_nodes"]), int(counts["max_nodes"])
    except ValueError as exc:
        raise _url_error(url, backend, f"node counts must be integers, got {counts}") from exc


def rendezvous_url(params: RendezvousParameters) -> str:
    """The URL of ``params``: ``parse_rendezvous_url(rendezvous_url(p)) == p``."""
    spec = backend_spec(params.backend)
    kind = spec.endpoint if spec else "host"
    run_id = quote(params.run_id, safe="")
    if kind == "none":
        head = f"{params.backend}://{run_id}"
    elif kind == "path":
        if not params.endpoint.startswith("/"):
            raise RendezvousParameterError(
                f"A {params.backend} URL needs an absolute directory, got {params.endpoint!r}."
            )
        head = f"{params.backend}://{quote(params.endpoint.rstrip('/'))}/{run_id}"
    else:
        head = f"{params.backend}://{params.endpoint}/{run_id}"
    query: dict[str, Any] = {"min_nodes": params.min_nodes, "max_nodes": params.max_nodes}
    if params.local_addr is not None:
        query["local_addr"] = params.local_addr
    query.update(sorted(params.config.items()))
    return f"{head}?{urlencode({k: str(v) for k, v in query.items() if v is not None})}"
