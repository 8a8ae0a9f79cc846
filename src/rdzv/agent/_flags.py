"""``rdzv run``'s command line: the one table of its flags (names, help, kind, default), their
registration with argparse, each flag's value resolved from the flag, its ``PET_*`` env var or
its default, and the parsers of the values that need more than a type (``--nnodes``,
``--nproc-per-node``, ``--redirects``, ``--rdzv-conf``). :mod:`._config` builds the checked
:class:`~._config.LaunchConfig` from them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y", "t"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", "n", "f", ""})
STREAMS = {"0": frozenset(), "1": frozenset({"stdout"}), "2": frozenset({"stderr"}),
           "3": frozenset({"stdout", "stderr"})}
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
    ("worker_connect_timeout", ("--worker-connect-timeout", "--worker_connect_timeout"),
     "Seconds a worker has after its start to connect to its agent through rdzv.torch (its "
     "Python and torch imports) before it is taken as not using the in-process API, so that a "
     "membership change restarts it: raise it where imports are slow (a shared file system), "
     "lower it for programs that do not use the API.", "float", 30.0),
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
    ("preload", ("--preload",),
     "Python modules (comma-separated, e.g. torch) that a worker template imports once, "
     "while the node joins; every worker is then forked from it and starts in milliseconds "
     "instead of importing them again at each start and restart. Python worker commands "
     "only (not with --no-python).", "str", ""),
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


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
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


def flag_name(dest: str) -> str:
    """The long flag of the option ``dest`` (``nnodes`` -> ``--nnodes``)."""
    return _long_flag(next(flags for name, flags, *_ in _OPTIONS if name == dest))


def checked_number(kind: type, raw: Any, source: str, minimum: float, example: str) -> Any:
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
    min_nodes = checked_number(int, low, source, 1, example)
    max_nodes = checked_number(int, high, source, 1, example) if sep else min_nodes
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
    return checked_number(int, raw, source, 1, "--nproc-per-node 4, auto, cpu or gpu")


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
