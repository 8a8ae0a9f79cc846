"""The launch configuration of ``rdzv run``: its flags, the PET_* env vars, and their validation.

The flags are torchrun's (both ``--nproc-per-node`` and ``--nproc_per_node`` spellings). Each
flag not given falls back to its env var ``PET_<NAME>`` (``PET_NNODES``, ``PET_RDZV_ENDPOINT``...),
then to what Slurm or a Kubernetes Indexed Job says (:mod:`._environment`), then to its default;
``LaunchConfig.origins`` keeps where each value came from (``rdzv run --print-config``).
:func:`config_from_args` turns the parsed flags into a checked :class:`LaunchConfig` or raises
:class:`ConfigError` naming the flag and saying how to fix it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._address import parse_endpoint
from .._messages import PROGRESS_EVERY
from ..errors import RendezvousParameterError
from ..rendezvous import RendezvousParameters, backend_spec, canonical_backend
from ._environment import derive
from ._slurm import SlurmError

TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y", "t"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", "n", "f", ""})
STREAMS = {"0": frozenset(), "1": frozenset({"stdout"}), "2": frozenset({"stderr"}),
           "3": frozenset({"stdout", "stderr"})}
STATIC_BACKEND = "static"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
ENDPOINT_EXAMPLES = {"file": "/shared/rdzv", "etcd": "HOST:2379"}
HANG_TIMEOUT_MIN = 2.0
"""The least ``--hang-timeout`` (other than 0): a few of the workers' progress reports."""


class ConfigError(ValueError):
    """A flag (or its env var) is malformed or contradicts another; the message says the fix."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class StreamChoice:
    """Which streams (``stdout``/``stderr``) of each local rank a --redirects/--tee value names."""

    default: frozenset[str] = frozenset()
    per_rank: Mapping[int, frozenset[str]] = field(default_factory=dict)

    def streams(self, local_rank: int) -> frozenset[str]:
        return self.per_rank.get(local_rank, self.default)


# (dest, flags, help, kind, default); kind: str, int, float, flag.
_OPTIONS: tuple[tuple[str, tuple[str, ...], str, str, Any], ...] = (
    ("nnodes", ("--nnodes",), "Number of nodes, N or MIN:MAX (elastic).", "str", "1:1"),
    ("nproc_per_node", ("--nproc-per-node", "--nproc_per_node"),
     "Workers per node: a number, auto, cpu or gpu.", "str", "1"),
    ("rdzv_backend", ("--rdzv-backend", "--rdzv_backend"),
     "Rendezvous backend: tcp (torch's c10d is an alias), file, etcd, static...", "str", "tcp"),
    ("rdzv_endpoint", ("--rdzv-endpoint", "--rdzv_endpoint"),
     "The backend's endpoint, e.g. host:29400 (tcp) or a shared directory (file).", "str", ""),
    ("rdzv_id", ("--rdzv-id", "--rdzv_id"), "The run id shared by every node of the job.",
     "str", "none"),
    ("rdzv_conf", ("--rdzv-conf", "--rdzv_conf"),
     "Backend options as key=value,key=value (e.g. join_timeout=60).", "str", ""),
    ("standalone", ("--standalone",),
     "One node with an embedded store on a free port; no other rendezvous flag needed.",
     "flag", False),
    ("max_restarts", ("--max-restarts", "--max_restarts"),
     "How many times a failed worker group is restarted before the run fails.", "int", 0),
    ("monitor_interval", ("--monitor-interval", "--monitor_interval"),
     "Seconds between checks for new or lost nodes while the workers run.", "float", 0.1),
    ("stop_timeout", ("--stop-timeout", "--stop_timeout"),
     "Seconds workers get to exit after SIGTERM before they are killed.", "float", 30.0),
    ("role", ("--role",), "The workers' role name.", "str", "default"),
    ("restart_on_change", ("--restart-on-change", "--restart_on_change"),
     "Restart the workers on every membership change, even when their training loop uses "
     "rdzv.torch.ElasticState and could switch to the new round in-process.", "flag", False),
    ("switch_timeout", ("--switch-timeout", "--switch_timeout"),
     "Seconds an in-process switch to a new round may take (newcomers starting included) "
     "before the agents restart the workers instead.", "float", 60.0),
    ("leave_grace", ("--leave-grace", "--leave_grace"),
     "Seconds a node asked to leave by SIGTERM or SIGINT keeps training while the other "
     "nodes form the next round without it (a second signal stops it at once).", "float", 30.0),
    ("hang_timeout", ("--hang-timeout", "--hang_timeout"),
     "Seconds a worker using rdzv.torch.ElasticState may make no progress before it is "
     "declared hung (its stacks logged, it is ended and the others recover without it): auto "
     "(20 of its slowest steps, at least 300 s), a number of seconds (at least 2), or 0 (off).",
     "str", "auto"),
    ("straggler_factor", ("--straggler-factor", "--straggler_factor"),
     "A node whose own work per step stays this many times the other nodes' (over about 15 s) "
     "is flagged as a straggler (0: off).", "float", 1.5),
    ("replace_stragglers", ("--replace-stragglers", "--replace_stragglers"),
     "Ask a straggler to leave gracefully when a spare node waits to take its place "
     "(in-process, at a step boundary).", "flag", False),
    ("node_rank", ("--node-rank", "--node_rank"), "This node's rank (static jobs).", "int", None),
    ("master_addr", ("--master-addr", "--master_addr"),
     "Address of the node with rank 0 (static jobs).", "str", None),
    ("master_port", ("--master-port", "--master_port"),
     "Port of the static job's store on the node with rank 0.", "int", None),
    ("local_addr", ("--local-addr", "--local_addr"),
     "This node's address as the other nodes reach it.", "str", None),
    ("log_dir", ("--log-dir", "--log_dir"),
     "Directory of the workers' log files (default: a new temporary directory).", "str", None),
    ("redirects", ("-r", "--redirects"),
     "Streams written only to the log files, not the console: 0 none, 1 stdout, 2 stderr, "
     "3 both, or per local rank as 0:1,1:2.", "str", "0"),
    ("tee", ("-t", "--tee"),
     "Streams shown on the console even if redirected (same values as --redirects).", "str", "0"),
    ("run_path", ("--run-path", "--run_path"),
     "Run the training script as a file path (python's runpy.run_path).", "flag", False),
    ("module", ("-m", "--module"), "The training script is a Python module (python -m).",
     "flag", False),
    ("no_python", ("--no-python", "--no_python"),
     "Run the training script as an executable, not with python.", "flag", False),
)

DEFAULTS: dict[str, Any] = {dest: default for dest, _flags, _text, _kind, default in _OPTIONS}
"""Each flag's default: the one table above gives them to the flags, their help and the
:class:`LaunchConfig` built without them."""


@dataclass(frozen=True)
class LaunchConfig:
    """Everything an agent needs to run one node of a job."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_backend: str
    rdzv_endpoint: str
    run_id: str
    rdzv_conf: Mapping[str, str]
    command: tuple[str, ...]
    """The worker command line: ``python -u script args``, ``python -u -m module`` or as given."""
    standalone: bool = DEFAULTS["standalone"]
    max_restarts: int = DEFAULTS["max_restarts"]
    monitor_interval: float = DEFAULTS["monitor_interval"]
    stop_timeout: float = DEFAULTS["stop_timeout"]
    role: str = DEFAULTS["role"]
    local_addr: str | None = None
    log_dir: str | None = None
    redirects: StreamChoice = StreamChoice()
    tee: StreamChoice = StreamChoice()
    node_rank: int | None = None
    """Static jobs only: this node's rank (``--node-rank``)."""
    restart_on_change: bool = DEFAULTS["restart_on_change"]
    """Restart the workers on every membership change, even when they could switch in-process."""
    switch_timeout: float = DEFAULTS["switch_timeout"]
    """Seconds an in-process switch may take before the agents restart the workers instead."""
    leave_grace: float = DEFAULTS["leave_grace"]
    """Seconds a node asked to leave (SIGTERM, SIGINT) keeps training while the others move on."""
    hang_timeout: float | None = None
    """Seconds a worker may make no progress before it is checked for a hang (None: derived
    from its step time; 0: off)."""
    straggler_factor: float = DEFAULTS["straggler_factor"]
    """A node whose steps take this many times the others' own work is a straggler (0: off)."""
    replace_stragglers: bool = DEFAULTS["replace_stragglers"]
    """Ask a straggler to leave when a spare can take its place."""
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Where each flag's value came from: the flag, its ``PET_*`` env var, ``Slurm: ...`` or
    ``default`` (by flag name, and ``rdzv_conf:KEY`` for rendezvous options Slurm set)."""

    def rendezvous_parameters(self) -> RendezvousParameters:
        """The rendezvous parameters of this node (ValueError if the backend rejects an
        option)."""
        return RendezvousParameters(self.rdzv_backend, self.rdzv_endpoint, self.run_id,
                                    self.min_nodes, self.max_nodes, self.local_addr,
                                    **self.rdzv_conf)



def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``rdzv run``'s flags and the training script with its arguments to ``parser``."""
    for dest, flags, text, kind, default in _OPTIONS:
        env = f"PET_{dest.upper()}"
        shown = f" Default: {default}." if default not in (None, False, "") else ""
        help_text = f"{text}{shown} Env: {env}."
        if kind == "flag":
            parser.add_argument(*flags, dest=dest, action="store_const", const=True,
                                default=None, help=help_text)
        else:
            parser.add_argument(*flags, dest=dest, default=None, metavar=dest.upper(),
                                help=help_text)
    parser.add_argument("--print-config", action="store_true",
                        help="Print the configuration this node would run with, each value "
                             "with where it came from (a flag, a PET_* env var, Slurm, a "
                             "default), and exit.")
    parser.add_argument("--log-level", default="WARNING",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="What rdzv's own log shows (DEBUG: also a failure's traceback). "
                             "Default: WARNING.")
    parser.add_argument("training_script", metavar="TRAINING_SCRIPT",
                        help="The worker program (a Python script, a module with -m, or an "
                             "executable with --no-python).")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER,
                        help="Arguments of the worker program.")


def _resolve(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Each option's raw value and where it came from (the flag, the env var, or 'default')."""
    resolved: dict[str, tuple[Any, str]] = {}
    for dest, flags, _text, kind, default in _OPTIONS:
        given = getattr(args, dest, None)
        name = f"PET_{dest.upper()}"
        if given is not None:
            resolved[dest] = (given, _long_flag(flags))
        elif name in env:
            value: Any = env[name]
            if kind == "flag":
                word = value.strip().lower()
                if word not in TRUE_WORDS | FALSE_WORDS:
                    raise ConfigError(name, f"{value!r} is not a boolean; use 1 or 0")
                value = word in TRUE_WORDS
            resolved[dest] = (value, name)
        else:
            resolved[dest] = (default, "default")
    return resolved


def _long_flag(flags: tuple[str, ...]) -> str:
    return next(flag for flag in flags if flag.startswith("--"))


def _number(kind: type, raw: Any, source: str, minimum: float, example: str) -> Any:
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(source, f"{raw!r} is not a{'n integer' if kind is int else ' number'}"
                                  f"; e.g. {example}") from None
    if value < minimum or value != value:
        raise ConfigError(source, f"must be >= {minimum:g}, got {raw!r}; e.g. {example}")
    return value


def parse_nnodes(raw: str, source: str = "--nnodes") -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` as (min, max), checked."""
    low, sep, high = str(raw).partition(":")
    example = "--nnodes 2 or --nnodes 1:4"
    if sep and not high:
        raise ConfigError(source, f"{raw!r} has no maximum after ':'; e.g. {example}")
    min_nodes = _number(int, low, source, 1, example)
    max_nodes = _number(int, high, source, 1, example) if sep else min_nodes
    if max_nodes < min_nodes:
        raise ConfigError(source, f"the maximum {max_nodes} is below the minimum {min_nodes}; "
                                  f"give MIN:MAX with MIN <= MAX, e.g. 1:4")
    return min_nodes, max_nodes


def gpu_count() -> int:
    """How many GPUs this node has: torch's count when torch is installed, else the driver's."""
    try:
        import torch  # noqa: PLC0415  (only for --nproc-per-node auto/gpu)

        return int(torch.cuda.device_count())
    except ImportError:
        pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def parse_nproc(raw: str, source: str = "--nproc-per-node") -> int:
    """A worker count, or ``auto`` (GPUs, else CPUs), ``cpu`` or ``gpu``."""
    word = str(raw).strip().lower()
    if word == "cpu":
        return os.cpu_count() or 1
    if word in ("gpu", "auto"):
        gpus = gpu_count()
        if gpus:
            return gpus
        if word == "gpu":
            raise ConfigError(source, "'gpu' but this node has no GPU; give a number or 'cpu'")
        return os.cpu_count() or 1
    return _number(int, raw, source, 1, "--nproc-per-node 4, auto, cpu or gpu")


def parse_streams(raw: str, source: str) -> StreamChoice:
    """A --redirects/--tee value: ``0``..``3`` for every rank, or ``0:1,1:3`` per local rank."""
    text = str(raw).strip()
    hint = "use 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank as 0:1,1:2"
    if text in STREAMS:
        return StreamChoice(STREAMS[text])
    per_rank: dict[int, frozenset[str]] = {}
    for item in text.split(","):
        rank, sep, streams = item.partition(":")
        if not sep or not rank.strip().isdigit() or streams.strip() not in STREAMS:
            raise ConfigError(source, f"{raw!r} is not a stream choice; {hint}")
        per_rank[int(rank)] = STREAMS[streams.strip()]
    return StreamChoice(frozenset(), per_rank)


def parse_rdzv_conf(raw: str, source: str = "--rdzv-conf") -> dict[str, str]:
    """``key=value,key=value`` as a dict; as torch's, an empty item or value is an error."""
    conf: dict[str, str] = {}
    text = str(raw).strip()
    if not text:
        return conf
    example = "e.g. --rdzv-conf join_timeout=60,last_call_timeout=5"
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not key:
            raise ConfigError(source, "The rendezvous configuration string must be in format "
                                      f"<key1>=<value1>,...,<keyN>=<valueN>; got {raw!r} (an "
                                      f"item without a key); {example}")
        if not sep or not value:
            raise ConfigError(source, f"The rendezvous configuration option '{key}' must have a "
                                      f"value specified; got {item.strip()!r}: give key=value, {example}")
        if key in conf:
            raise ConfigError(source, f"option {key!r} is given twice")
        conf[key] = value
    return conf


def worker_command(script: str, script_args: list[str], module: bool, no_python: bool,
                   run_path: bool) -> tuple[str, ...]:
    """The command line that starts one worker."""
    if sum((module, no_python, run_path)) > 1:
        raise ConfigError("-m/--no-python/--run-path", "give at most one of them")
    if no_python:
        return (script, *script_args)
    if module:
        return (sys.executable, "-u", "-m", script, *script_args)
    if run_path and not os.path.isfile(script):
        raise ConfigError("--run-path", f"{script!r} is not a file; give the script's path")
    return (sys.executable, "-u", script, *script_args)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> LaunchConfig:
    """Check the parsed flags (falling back to PET_* env vars) and build the launch config."""
    env = os.environ if env is None else env
    values = _resolve(args, env)

    def raw(dest: str) -> Any:
        return values[dest][0]

    def given(dest: str) -> bool:
        return values[dest][1] != "default"

    def source(dest: str) -> str:
        where = values[dest][1]
        return where if where != "default" else _long_flag(next(o[1] for o in _OPTIONS
                                                                 if o[0] == dest))

    static_flags = [d for d in ("master_addr", "master_port", "node_rank") if given(d)]
    standalone = bool(raw("standalone"))
    derived_conf: dict[str, str] = {}
    if not standalone and not static_flags \
            and str(raw("rdzv_backend")).strip().lower() != STATIC_BACKEND:
        derived_conf = _from_environment(values, env)
    min_nodes, max_nodes = parse_nnodes(raw("nnodes"), source("nnodes"))
    nproc = parse_nproc(raw("nproc_per_node"), source("nproc_per_node"))
    backend = canonical_backend(str(raw("rdzv_backend")))
    endpoint = str(raw("rdzv_endpoint")).strip()
    run_id = str(raw("rdzv_id")).strip()
    conf = parse_rdzv_conf(raw("rdzv_conf"), source("rdzv_conf"))
    origins = {dest: where for dest, (_value, where) in values.items()}
    origins.update((f"rdzv_conf:{key}", source("rdzv_conf")) for key in conf)
    for key, value in derived_conf.items():
        if key not in conf:
            conf[key] = value
            origins[f"rdzv_conf:{key}"] = values[f"rdzv_conf:{key}"][1]
    node_rank = None
    if standalone:
        clashing = [d for d in ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr",
                                "master_port", "node_rank") if given(d)]
        if clashing:
            raise ConfigError("--standalone", f"cannot be combined with {source(clashing[0])}: "
                                              "a standalone run makes its own rendezvous; drop one")
        if max_nodes != 1:
            raise ConfigError("--standalone", f"runs one node but {source('nnodes')} asks for "
                                              f"{raw('nnodes')}; drop one of them")
        backend, endpoint, run_id = "tcp", "127.0.0.1:0", f"standalone-{uuid.uuid4().hex[:8]}"
    elif static_flags and not given("rdzv_backend") and not given("rdzv_endpoint"):
        backend = STATIC_BACKEND
    if backend == STATIC_BACKEND:
        if min_nodes != max_nodes:
            raise ConfigError(source("nnodes"), f"a static job has a fixed size, got "
                                                f"{raw('nnodes')}; give one number, or use an "
                                                "elastic backend such as --rdzv-backend tcp")
        node_rank = _number(int, raw("node_rank") or 0, source("node_rank"), 0, "--node-rank 0")
        if node_rank >= max_nodes:
            raise ConfigError(source("node_rank"), f"{node_rank} is not below the number of "
                                                   f"nodes {max_nodes}; ranks are 0..{max_nodes - 1}")
        if not endpoint:
            port = _number(int, raw("master_port") or DEFAULT_MASTER_PORT, source("master_port"),
                           1, "--master-port 29500")
            endpoint = f"{raw('master_addr') or DEFAULT_MASTER_ADDR}:{port}"
        elif given("master_addr") or given("master_port"):
            raise ConfigError(source(static_flags[0]), "the static store is given twice (also "
                                                       "by --rdzv-endpoint); drop one of them")
        for key, value in (("rank", str(node_rank)), ("world_size", str(max_nodes))):
            if key not in conf:
                conf[key] = value
                origins[f"rdzv_conf:{key}"] = "static job: --node-rank, --nnodes"
        if run_id == "none":
            run_id = "static"
    elif static_flags:
        raise ConfigError(source(static_flags[0]), f"is for static jobs but the rendezvous "
                                                   f"backend is {backend}; drop it (the "
                                                   "rendezvous assigns ranks and the master)")
    elif not endpoint and backend in ("file", "etcd"):
        raise ConfigError("--rdzv-endpoint", f"the {backend} backend needs an endpoint, e.g. "
                                             f"--rdzv-endpoint {ENDPOINT_EXAMPLES[backend]} (or "
                                             "use --standalone for a single node)")
    elif backend == "tcp":
        try:  # (as torch's c10d: empty is localhost:29400, a missing port 29400)
            host, port = parse_endpoint(endpoint, backend_spec("tcp").default_port)  # type: ignore[union-attr]
        except RendezvousParameterError as exc:
            raise ConfigError(source("rdzv_endpoint"), str(exc)) from None
        endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        run_id=run_id,
        rdzv_conf=conf,
        command=worker_command(args.training_script, list(args.training_script_args),
                               bool(raw("module")), bool(raw("no_python")), bool(raw("run_path"))),
        standalone=standalone,
        max_restarts=_number(int, raw("max_restarts"), source("max_restarts"), 0,
                             "--max-restarts 3"),
        monitor_interval=_number(float, raw("monitor_interval"), source("monitor_interval"),
                                 0.001, "--monitor-interval 0.5"),
        stop_timeout=_number(float, raw("stop_timeout"), source("stop_timeout"), 0,
                             "--stop-timeout 30"),
        role=_role(raw("role"), source("role")),
        local_addr=raw("local_addr"),
        log_dir=raw("log_dir"),
        redirects=parse_streams(raw("redirects"), source("redirects")),
        tee=parse_streams(raw("tee"), source("tee")),
        node_rank=node_rank,
        restart_on_change=bool(raw("restart_on_change")),
        switch_timeout=_number(float, raw("switch_timeout"), source("switch_timeout"), 0.001,
                               "--switch-timeout 60"),
        leave_grace=_number(float, raw("leave_grace"), source("leave_grace"), 0,
                            "--leave-grace 30"),
        hang_timeout=_hang_timeout(raw("hang_timeout"), source("hang_timeout")),
        straggler_factor=_straggler_factor(raw("straggler_factor"), source("straggler_factor")),
        replace_stragglers=bool(raw("replace_stragglers")),
        origins=origins,
    )


def _from_environment(values: dict[str, tuple[Any, str]], env: Mapping[str, str]
                      ) -> dict[str, str]:
    """Fill the flags not given (in ``values``) from Slurm's or Kubernetes' environment; the
    rendezvous options it sets."""
    given = {dest: (None if values[dest][1] == "default" else str(values[dest][0]))
             for dest in ("nnodes", "rdzv_id", "rdzv_endpoint", "rdzv_backend", "local_addr")}
    try:
        derived = derive(env, given)
    except SlurmError as exc:
        raise ConfigError("Slurm", str(exc)) from None
    conf: dict[str, str] = {}
    for name, (value, origin) in derived.items():
        if name in values:
            if values[name][1] == "default":
                values[name] = (value, origin)
        else:
            conf[name] = value
            values[f"rdzv_conf:{name}"] = (value, origin)
    return conf


def _hang_timeout(raw: Any, source: str) -> float | None:
    if str(raw).strip().lower() == "auto":
        return None
    example = "--hang-timeout 600 (0: off, auto: derived from the step time)"
    seconds = float(_number(float, raw, source, 0, example))
    if 0 < seconds < HANG_TIMEOUT_MIN:
        raise ConfigError(source, f"must be at least {HANG_TIMEOUT_MIN:g} s (workers report "
                                  f"their progress every {PROGRESS_EVERY:g} s), or 0 to turn "
                                  f"the watch off; got {raw!r}; e.g. {example}")
    return seconds


def _straggler_factor(raw: Any, source: str) -> float:
    factor = float(_number(float, raw, source, 0, "--straggler-factor 1.5 (0: off)"))
    if 0 < factor <= 1:
        raise ConfigError(source, f"must be above 1 (a node that many times slower than the "
                                  f"others), or 0 to turn the check off; got {raw!r}")
    return factor


def _role(raw: str, source: str) -> str:
    role = str(raw).strip()
    if not role or any(ch.isspace() or ch in ",/" for ch in role):
        raise ConfigError(source, f"{raw!r} is not a role name; use letters, digits, - or _")
    return role


def check_command(config: LaunchConfig) -> None:
    """The worker program can be started (an executable exists, a script file exists)."""
    program = config.command[0]
    if program != sys.executable and shutil.which(program) is None:
        raise ConfigError("--no-python", f"{program!r} is not an executable on PATH")
    if config.command[:2] == (sys.executable, "-u") and config.command[2] != "-m":
        if not os.path.isfile(config.command[2]):
            raise ConfigError("TRAINING_SCRIPT", f"{config.command[2]!r} does not exist; give "
                                                 "the path of a Python script (or -m MODULE)")
