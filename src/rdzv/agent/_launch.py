"""Starting an agent from the command line: flags to config, config to handler, run, exit code.

Shared by ``rdzv run`` and ``python -m rdzv.run``. Bad flags print what is wrong and how to fix
it and give exit code 2, as argparse does for the errors it finds itself.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from .._patience import notice_if_slow
from ..errors import RendezvousError
from ..rendezvous import RendezvousHandler, get_rendezvous_handler
from ._agent import ElasticAgent, say
from ._config import LaunchConfig, check_command, config_from_args
from ._flags import ConfigError

logger = logging.getLogger(__name__)

USAGE_ERROR = 2
FAILED = 1
"""The exit code of a run that could not start or failed (the workers', past restarts)."""

STANDALONE_HOST = "127.0.0.1"


def standalone_handler(config: LaunchConfig) -> tuple[RendezvousHandler, LaunchConfig]:
    """A one-node rendezvous on a store server embedded in this process, on a free port."""
    from ..rendezvous import DynamicRendezvousHandler
    from ..store import TCPStore

    params = config.rendezvous_parameters()
    store = TCPStore(STANDALONE_HOST, 0, is_master=True, timeout=params.get_option("read_timeout"))
    handler = DynamicRendezvousHandler(
        store, config.run_id, 1, 1, backend="tcp", local_addr=STANDALONE_HOST,
        join_timeout=params.get_option("join_timeout"), last_call_timeout=0.0,
        on_shutdown=store.close,
    )
    return handler, replace(config, rdzv_endpoint=f"{STANDALONE_HOST}:{store.port}")


def open_handler(config: LaunchConfig) -> RendezvousHandler:
    """The rendezvous handler of ``config``'s backend (reaching its store); once that lasts a
    second, the console says what it waits for, how long at most, and the option that sets it
    (the store client then says why, every 10 s)."""
    params = config.rendezvous_parameters()
    try:
        how = (f"retrying for up to {params.get_option('read_timeout'):g} s (--rdzv-conf "
               "read_timeout=SECONDS)")
    except KeyError:  # a backend without that option (static)
        how = "retrying"
    with notice_if_slow(say, f"reaching the rendezvous store ({config.rdzv_backend} "
                             f"{config.rdzv_endpoint}) for run {config.run_id!r}: {how}"):
        return get_rendezvous_handler(params)


def unreachable(config: LaunchConfig, exc: RendezvousError) -> str:
    """What to tell the person when the rendezvous could not be reached: what failed, the
    likely causes, what to do."""
    where = f"{config.rdzv_backend} {config.rdzv_endpoint}"
    text = str(exc)
    if "resolve the host name" in text:
        causes = ("the host name in --rdzv-endpoint is misspelt, or its DNS name does not exist "
                  "(yet)")
        todo = "check --rdzv-endpoint's host; --rdzv-conf read_timeout=SECONDS waits longer"
    elif "is taken on it" in text:
        causes = "another program (or another job's store) listens on that port of this node"
        todo = ("give --rdzv-endpoint with a free port (the same on every node), or stop what "
                "listens there (`ss -ltnp` shows it)")
    elif config.rdzv_backend == "etcd":
        causes = f"etcd is not running at {config.rdzv_endpoint}, or a firewall drops the port"
        todo = ("start etcd there (see docs/etcd.md), or check --rdzv-endpoint; without etcd, "
                "`rdzv serve` and --rdzv-backend tcp")
    elif config.rdzv_backend == "tcp":  # (canonical: config_from_args named it)
        causes = ("no store server listens there: a wrong host or port in --rdzv-endpoint; the "
                  "node that hosted the store (is_host) has exited, taking the store with it; or "
                  "a firewall")
        todo = ("check --rdzv-endpoint; run a store the nodes outlive (`rdzv serve --port PORT` "
                "on that host) or use etcd; on one machine, --standalone needs none")
    else:
        causes, todo = f"the {config.rdzv_backend} backend's store cannot be reached", \
            "check --rdzv-endpoint and --rdzv-conf"
    return (f"rdzv run: error: cannot reach the rendezvous ({where}) for run {config.run_id!r}: "
            f"{exc}\n  likely: {causes}\n  to do: {todo}\n  (exit code {FAILED}; "
            "--log-level DEBUG shows the traceback)")


def launch(config: LaunchConfig) -> int:
    """Run one node of the job described by ``config``; the exit code."""
    if config.standalone:
        handler, config = standalone_handler(config)
    else:
        try:
            handler = open_handler(config)
        except RendezvousError as exc:
            logger.debug("reaching the rendezvous failed", exc_info=True)
            print(unreachable(config, exc), file=sys.stderr)
            return FAILED
    host = config.local_addr or (STANDALONE_HOST if config.standalone else None)
    return ElasticAgent(config, handler, host=host).run()


def run_from_args(args: argparse.Namespace) -> int:
    """The ``func`` of ``rdzv run``: check the flags, then launch."""
    try:
        config = config_from_args(args)
        config.rendezvous_parameters()
        if getattr(args, "print_config", False):  # (the script need not be on this machine)
            print(describe(config))
            return 0
        check_command(config)
    except (ConfigError, ValueError) as exc:
        print(f"rdzv run: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        return launch(config)
    except ValueError as exc:  # the backend rejected its parameters when creating the handler
        print(f"rdzv run: error: {exc}", file=sys.stderr)
        return USAGE_ERROR


def describe(config: LaunchConfig) -> str:
    """``rdzv run --print-config``: each value this node runs with, and where it came from."""
    origins = config.origins
    nnodes = (str(config.min_nodes) if config.min_nodes == config.max_nodes
              else f"{config.min_nodes}:{config.max_nodes}")
    rows = [
        ("nnodes", nnodes, origins.get("nnodes", "default")),
        ("nproc_per_node", str(config.nproc_per_node), origins.get("nproc_per_node", "default")),
        ("rdzv_backend", config.rdzv_backend, origins.get("rdzv_backend", "default")),
        ("rdzv_endpoint", config.rdzv_endpoint or "(none)",
         origins.get("rdzv_endpoint", "default")),
        ("rdzv_id", config.run_id, origins.get("rdzv_id", "default")),
        ("local_addr", config.local_addr or "(this machine's name)",
         origins.get("local_addr", "default")),
    ]
    for key, value in sorted(config.rdzv_conf.items()):
        rows.append((f"rdzv_conf {key}", value, origins.get(f"rdzv_conf:{key}", "default")))
    if config.preload:
        rows.append(("preload", ",".join(config.preload), origins.get("preload", "default")))
    value_width = max(len(value) for _n, value, _o in rows)
    rows.append(("command", " ".join(config.command), "TRAINING_SCRIPT"))
    width = max(len(name) for name, _v, _o in rows)
    return "\n".join(f"{name:<{width}}  {value:<{value_width}}  ({origin})"
                     for name, value, origin in rows)
