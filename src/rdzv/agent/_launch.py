"""Starting an agent from the command line: flags to config, config to handler, run, exit code.

Shared by ``rdzv run`` and ``python -m rdzv.run``. Bad flags print what is wrong and how to fix
it and give exit code 2, as argparse does for the errors it finds itself.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from ..rendezvous import RendezvousHandler, RendezvousParameters, get_rendezvous_handler
from ._agent import ElasticAgent
from ._config import ConfigError, LaunchConfig, check_command, config_from_args

logger = logging.getLogger(__name__)

USAGE_ERROR = 2

STANDALONE_HOST = "127.0.0.1"


def rendezvous_parameters(config: LaunchConfig) -> RendezvousParameters:
    """The rendezvous parameters of ``config`` (ValueError if the backend rejects an option)."""
    return RendezvousParameters(
        config.rdzv_backend, config.rdzv_endpoint, config.run_id, config.min_nodes,
        config.max_nodes, config.local_addr, **config.rdzv_conf,
    )


def standalone_handler(config: LaunchConfig) -> tuple[RendezvousHandler, LaunchConfig]:
    """A one-node rendezvous on a store server embedded in this process, on a free port."""
    from ..rendezvous._engine import DynamicRendezvousHandler
    from ..store._tcp import TCPStore

    params = rendezvous_parameters(config)
    store = TCPStore(STANDALONE_HOST, 0, is_master=True, timeout=params.get_option("read_timeout"))
    handler = DynamicRendezvousHandler(
        store, config.run_id, 1, 1, backend="tcp", local_addr=STANDALONE_HOST,
        join_timeout=params.get_option("join_timeout"), last_call_timeout=0.0,
        on_shutdown=store.close,
    )
    return handler, replace(config, rdzv_endpoint=f"{STANDALONE_HOST}:{store.port}")


def launch(config: LaunchConfig) -> int:
    """Run one node of the job described by ``config``; the exit code."""
    if config.standalone:
        handler, config = standalone_handler(config)
    else:
        handler = get_rendezvous_handler(rendezvous_parameters(config))
    host = config.local_addr or (STANDALONE_HOST if config.standalone else None)
    return ElasticAgent(config, handler, host=host).run()


def run_from_args(args: argparse.Namespace) -> int:
    """The ``func`` of ``rdzv run``: check the flags, then launch."""
    try:
        config = config_from_args(args)
        check_command(config)
        rendezvous_parameters(config)
    except (ConfigError, ValueError) as exc:
        print(f"rdzv run: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        return launch(config)
    except ValueError as exc:  # the backend rejected its parameters when creating the handler
        print(f"rdzv run: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
