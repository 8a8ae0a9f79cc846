"""The options of each built-in rendezvous backend, declared once, and their validation.

Each backend has one table of :class:`Option` (name, type, default, doc). The checks of
``RendezvousParameters``, the typed accessor ``RendezvousParameters.get_option`` and the option
tables of ``docs/rendezvous.md`` (see :func:`options_markdown`) are all derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import RendezvousParameterError

_TRUE_STRINGS = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE_STRINGS = frozenset({"0", "false", "f", "no", "n", "off"})

RENAMED_PARAMETERS = {"min_workers": "min_nodes", "max_workers": "max_nodes"}
"""torch's older names of RendezvousParameters' own arguments (the etcd URLs still use them)."""

_TYPE_NAMES = {float: "seconds", int: "int", bool: "bool", str: "str"}


@dataclass(frozen=True)
class Option:
    """One backend option: its name, type, default (None: decided at run time) and meaning."""

    name: str
    type: type
    default: Any
    doc: str
    minimum: float | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()

    def convert(self, value: Any, backend: str) -> Any:
        """``value`` as this option's type, or ValueError saying what is expected."""
        try:
            converted = convert_value(self.type, value)
        except (TypeError, ValueError):
            converted = None
        if converted is None:
            raise RendezvousParameterError(
                f"The option '{self.name}' of the '{backend}' rendezvous backend must be "
                f"{self.expected()}, got {value!r}."
            )
        if self.minimum is not None and converted < self.minimum:
            raise RendezvousParameterError(
                f"The option '{self.name}' of the '{backend}' rendezvous backend must be "
                f"{self.expected()}, got {value!r}."
            )
        if self.choices and converted not in self.choices:
            raise RendezvousParameterError(
                f"The option '{self.name}' of the '{backend}' rendezvous backend must be one of "
                f"{', '.join(self.choices)}; got {value!r}."
            )
        return converted

    def expected(self) -> str:
        """What a valid value looks like, for error messages."""
        if self.type is bool:
            return "a boolean (1/true/yes/on or 0/false/no/off)"
        if self.type is float:
            text = "a number of seconds"
        elif self.type is int:
            text = "an integer"
        else:
            return "a string"
        if self.minimum is not None:
            text += f" >= {self.minimum:g}" if self.minimum else " >= 0"
        return text


def convert_value(kind: type, value: Any) -> Any:
    """``value`` as ``kind``, or None when it cannot represent one."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            text = value.strip().lower()
            return True if text in _TRUE_STRINGS else False if text in _FALSE_STRINGS else None
        return None
    if isinstance(value, bool):
        return None
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            return None
        return int(value)
    if kind is float:
        result = float(value)
        return result if result == result and result != float("inf") else None
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class BackendSpec:
    """A built-in backend: its URL endpoint form and its option table."""

    name: str
    endpoint: str
    """``"host"`` (host:port in the URL), ``"path"`` (a directory) or ``"none"``."""
    options: tuple[Option, ...]
    summary: str
    default_port: int | None = None

    def option(self, name: str) -> Option | None:
        """The option called ``name`` (or one of its aliases), or None."""
        for option in self.options:
            if name == option.name or name in option.aliases:
                return option
        return None

    def names(self) -> list[str]:
        return [option.name for option in self.options]


_ROUND_OPTIONS = (
    Option("join_timeout", float, 600.0, "How long a node waits for a round to form before "
           "RendezvousTimeoutError.", minimum=0),
    Option("last_call_timeout", float, 30.0, "Once min_nodes have joined, how long the round "
           "stays open for more nodes before it completes.", minimum=0),
    Option("close_timeout", float, 30.0, "How long shutdown() waits for its writes to reach "
           "the store before giving up.", minimum=0),
    Option("heartbeat_interval", float, 5.0, "Seconds between a node's heartbeats to the store.", minimum=0.01, aliases=("keep_alive_interval",)),
    Option("heartbeat_misses", int, 3, "Missed heartbeats after which a hung node is dropped; "
           "the store's session_ttl is heartbeat_interval x heartbeat_misses.", minimum=1, aliases=("keep_alive_max_attempt",)),
    Option("read_timeout", float, 60.0, "Timeout of a single store operation.", minimum=0.01),
    Option("timeout", float, 900.0, "Accepted for torchrun, which always passes it; the "
           "dynamic backends use join_timeout.", minimum=0),
    Option("history_size", int, 10_000, "The newest events the run's history keeps in its "
           "store (rdzv status --events); 0 records none.", minimum=0),
    Option("node_order", int, None, "This node's place among the newcomers of a round: nodes "
           "with a lower number get lower ranks, nodes without one come last, by host (rdzv run "
           "sets it to SLURM_NODEID under Slurm, to JOB_COMPLETION_INDEX in a Kubernetes Indexed "
           "Job).", minimum=0),
)

_ETCD_OPTIONS = (
    Option("protocol", str, "http", "http or https.", choices=("http", "https")),
    Option("ca_cert", str, None, "CA certificate file (https).", aliases=("cacert",)),
    Option("ssl_cert", str, None, "Client certificate file (https).", aliases=("cert",)),
    Option("ssl_cert_key", str, None, "Key of the client certificate (https).", aliases=("key",)),
    Option("user", str, None, "etcd user name (else env RDZV_ETCD_USER); needs a password."),
    Option("password", str, None, "The etcd user's password. A URL or command line shows it "
           "to every process lister: prefer password_file or env RDZV_ETCD_PASSWORD."),
    Option("password_file", str, None, "File holding the etcd user's password (a trailing "
           "newline is not part of it)."),
    Option("etcd_prefix", str, "/rdzv", "Key prefix under which the runs live."),
)

_TCP = BackendSpec(
    "tcp", "host", _ROUND_OPTIONS + (
        Option("is_host", bool, None, "Whether this node hosts the store server (default: "
               "when the endpoint's host is one of this machine's addresses)."),
        Option("secret_file", str, None, "File holding the store server's shared secret "
               "(else env RDZV_STORE_SECRET; none: no authentication)."),
        Option("use_libuv", bool, True, "Accepted for torch compatibility; has no effect."),
    ),
    "Dynamic rendezvous on rdzv's TCP store server (torch: c10d). The node whose address is "
    "the endpoint hosts the server, or connect to a standalone `rdzv serve`.",
    default_port=29400,
)

BACKEND_ALIASES: dict[str, str] = {"c10d": "tcp"}
"""Other names of built-in backends: torch's ``c10d`` is rdzv's ``tcp``."""


def canonical_backend(name: str) -> str:
    """The backend ``name`` stands for, as rdzv names it (``c10d`` -> ``tcp``), lowercased."""
    name = name.strip().lower()
    return BACKEND_ALIASES.get(name, name)


BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        _TCP,
        BackendSpec("c10d", "host", _TCP.options, "Same as tcp (torch's name).", 29400),
        BackendSpec("file", "path", _ROUND_OPTIONS, "Dynamic rendezvous on a FileStore in a "
                    "directory shared by every node (NFS, Lustre)."),
        BackendSpec("memory", "none", _ROUND_OPTIONS, "Dynamic rendezvous inside one process "
                    "(HashStore), for tests."),
        BackendSpec("etcd", "host", _ROUND_OPTIONS + _ETCD_OPTIONS, "Dynamic rendezvous on "
                    "etcd v3; the endpoint may list several host:port separated by commas.",
                    2379),
        BackendSpec("static", "host", (
            Option("rank", int, None, "This node's rank (default: env RANK).", minimum=0),
            Option("world_size", int, None, "The number of nodes (default: env WORLD_SIZE, "
                   "else max_nodes); min_nodes = max_nodes = world_size.", minimum=1),
            Option("timeout", float, 600.0, "How long to wait for every node to arrive; also "
                   "the store's timeout for blocking calls.", minimum=0),
        ), "Fixed rank and world size, no re-forming (torch: static). Rank 0 hosts the store "
           "at the endpoint (the master address and port).", 29400),
    )
}


def backend_spec(backend: str) -> BackendSpec | None:
    """The spec of a built-in backend, or None for a third-party one."""
    return BACKENDS.get(backend)


def check_config(backend: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """Validate the options given to ``backend``; returns them under their current names.

    A third-party backend's options pass unchecked (its creator checks them).
    """
    spec = backend_spec(backend)
    if spec is None:
        return dict(config)
    checked: dict[str, Any] = {}
    for key, value in config.items():
        option = spec.option(key)
        if option is None:
            raise RendezvousParameterError(unknown_option_message(spec, key))
        if option.name in checked:
            raise RendezvousParameterError(
                f"The option '{option.name}' of the '{backend}' rendezvous backend was given "
                f"twice (also as {', '.join(repr(a) for a in option.aliases)}); give it once."
            )
        if value is not None:
            option.convert(value, backend)
        checked[option.name] = value
    return checked


def unknown_option_message(spec: BackendSpec, key: str) -> str:
    """The error message for an option the backend does not have, with a suggestion."""
    import difflib  # only on this error path: `import rdzv` stays fast

    message = f"Unknown option '{key}' for the '{spec.name}' rendezvous backend."
    renamed = RENAMED_PARAMETERS.get(key)
    known = spec.names() + [a for o in spec.options for a in o.aliases]
    close = difflib.get_close_matches(key, known + ["min_nodes", "max_nodes", "local_addr"], 1)
    if renamed:
        message += f" '{key}' is torch's older name of '{renamed}'; use '{renamed}'."
    elif close:
        message += f" Did you mean '{close[0]}'?"
    return message + f" Valid options: {', '.join(spec.names())}."


def option_value(backend: str, name: str, config: Mapping[str, Any]) -> Any:
    """Option ``name`` of ``backend`` from ``config``, converted, or the option's default."""
    spec = backend_spec(backend)
    option = spec.option(name) if spec else None
    if spec is None or option is None:
        where = f"the '{backend}' rendezvous backend" if spec else f"backend '{backend}'"
        raise KeyError(f"{where} declares no option '{name}'")
    value = config.get(option.name)
    return option.default if value is None else option.convert(value, backend)


def options_markdown(backend: str) -> str:
    """The option table of ``backend`` as Markdown (what ``docs/rendezvous.md`` shows)."""
    spec = BACKENDS[backend]
    lines = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for option in spec.options:
        default = "auto" if option.default is None else f"`{option.default}`"
        doc = option.doc
        if option.aliases:
            doc += f" Also accepted as {', '.join(f'`{a}`' for a in option.aliases)} (torch)."
        lines.append(
            f"| `{option.name}` | {_TYPE_NAMES[option.type]} | {default} | {doc} |"
        )
    return "\n".join(lines)
