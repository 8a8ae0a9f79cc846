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
import importlib.machinery
import importlib.util
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
from ._flags import (
    DEFAULTS,
    ConfigError,
    StreamChoice,
    checked_number,
    flag_name,
    parse_nnodes,
    parse_nproc,
    parse_rdzv_conf,
    parse_streams,
    resolve,
)
from ._slurm import SlurmError
from ._template import python_program, worker_path

STATIC_BACKEND = "static"
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
ENDPOINT_EXAMPLES = {"file": "/shared/rdzv", "etcd": "HOST:2379"}
HANG_TIMEOUT_MIN = 2.0
"""The least ``--hang-timeout`` (other than 0): a few of the workers' progress reports."""


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
    worker_connect_timeout: float = DEFAULTS["worker_connect_timeout"]
    """Seconds a worker has after its start to connect through the in-process API."""
    hang_timeout: float | None = None
    """Seconds a worker may make no progress before it is checked for a hang (None: derived
    from its step time; 0: off)."""
    straggler_factor: float = DEFAULTS["straggler_factor"]
    """A node whose steps take this many times the others' own work is a straggler (0: off)."""
    replace_stragglers: bool = DEFAULTS["replace_stragglers"]
    """Ask a straggler to leave when a spare can take its place."""
    preload: tuple[str, ...] = ()
    """Modules the worker template imports once; workers are forked from it (empty: none)."""
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Where each flag's value came from: the flag, its ``PET_*`` env var, ``Slurm: ...`` or
    ``default`` (by flag name, and ``rdzv_conf:KEY`` for rendezvous options Slurm set)."""

    def rendezvous_parameters(self) -> RendezvousParameters:
        """The rendezvous parameters of this node (ValueError if the backend rejects an
        option)."""
        return RendezvousParameters(self.rdzv_backend, self.rdzv_endpoint, self.run_id,
                                    self.min_nodes, self.max_nodes, self.local_addr,
                                    **self.rdzv_conf)


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
    values = resolve(args, env)

    def raw(dest: str) -> Any:
        return values[dest][0]

    def given(dest: str) -> bool:
        return values[dest][1] != "default"

    def source(dest: str) -> str:
        where = values[dest][1]
        return where if where != "default" else flag_name(dest)

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
        node_rank = checked_number(int, raw("node_rank") or 0, source("node_rank"), 0, "--node-rank 0")
        if node_rank >= max_nodes:
            raise ConfigError(source("node_rank"), f"{node_rank} is not below the number of "
                                                   f"nodes {max_nodes}; ranks are 0..{max_nodes - 1}")
        if not endpoint:
            port = checked_number(int, raw("master_port") or DEFAULT_MASTER_PORT, source("master_port"),
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
        max_restarts=checked_number(int, raw("max_restarts"), source("max_restarts"), 0,
                             "--max-restarts 3"),
        monitor_interval=checked_number(float, raw("monitor_interval"), source("monitor_interval"),
                                 0.001, "--monitor-interval 0.5"),
        stop_timeout=checked_number(float, raw("stop_timeout"), source("stop_timeout"), 0,
                             "--stop-timeout 30"),
        role=_role(raw("role"), source("role")),
        local_addr=raw("local_addr"),
        log_dir=raw("log_dir"),
        redirects=parse_streams(raw("redirects"), source("redirects")),
        tee=parse_streams(raw("tee"), source("tee")),
        node_rank=node_rank,
        restart_on_change=bool(raw("restart_on_change")),
        switch_timeout=checked_number(float, raw("switch_timeout"), source("switch_timeout"), 0.001,
                               "--switch-timeout 60"),
        leave_grace=checked_number(float, raw("leave_grace"), source("leave_grace"), 0,
                            "--leave-grace 30"),
        worker_connect_timeout=checked_number(float, raw("worker_connect_timeout"),
                                              source("worker_connect_timeout"), 0,
                                              "--worker-connect-timeout 30"),
        hang_timeout=_hang_timeout(raw("hang_timeout"), source("hang_timeout")),
        straggler_factor=_straggler_factor(raw("straggler_factor"), source("straggler_factor")),
        replace_stragglers=bool(raw("replace_stragglers")),
        preload=_modules(raw("preload"), source("preload")),
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


def _modules(raw: Any, source: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in str(raw or "").split(",") if name.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(source, f"{name!r} is not a Python module name; give modules as "
                                      "--preload torch or --preload torch,numpy")
    return names


def _hang_timeout(raw: Any, source: str) -> float | None:
    if str(raw).strip().lower() == "auto":
        return None
    example = "--hang-timeout 600 (0: off, auto: derived from the step time)"
    seconds = float(checked_number(float, raw, source, 0, example))
    if 0 < seconds < HANG_TIMEOUT_MIN:
        raise ConfigError(source, f"must be at least {HANG_TIMEOUT_MIN:g} s (workers report "
                                  f"their progress every {PROGRESS_EVERY:g} s), or 0 to turn "
                                  f"the watch off; got {raw!r}; e.g. {example}")
    return seconds


def _straggler_factor(raw: Any, source: str) -> float:
    factor = float(checked_number(float, raw, source, 0, "--straggler-factor 1.5 (0: off)"))
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
    if config.preload:
        python = python_program(config.command)
        if program != sys.executable or python is None:
            raise ConfigError("--preload", "forks Python workers from a template; it cannot "
                                           "start an executable (drop --no-python or --preload)")
        for name in config.preload:
            top = name.split(".")[0]  # (found without importing; next to the script as well)
            if importlib.machinery.PathFinder.find_spec(top, [worker_path(python[0])]) is None \
                    and importlib.util.find_spec(top) is None:
                raise ConfigError("--preload", f"no module named {name!r} in {sys.executable}; "
                                               "give modules the workers import, e.g. "
                                               "--preload torch")
    if program != sys.executable and shutil.which(program) is None:
        raise ConfigError("--no-python", f"{program!r} is not an executable on PATH")
    if config.command[:2] == (sys.executable, "-u") and config.command[2] != "-m":
        if not os.path.isfile(config.command[2]):
            raise ConfigError("TRAINING_SCRIPT", f"{config.command[2]!r} does not exist; give "
                                                 "the path of a Python script (or -m MODULE)")
