"""Starting an agent from the command line: flags to config, config to handler, run, exit code.

Shared by ``rdzv run`` and ``python -m rdzv.run``. Bad flags print what is wrong and how to fix
it and give exit code 2, as argparse does for the errors it finds itself.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..rendezvous import RendezvousHandler, RendezvousParameters, get_rendezvous_handler
from ._agent import ElasticAgent
from ._config import ConfigError, LaunchConfig, check_command, config_from_args

logger = logging.getLogger(__name__)

USAGE_ERROR = 2

STANDALONE_CONF = {"is_host": "true", "last_call_timeout": "0"}
"""A standalone run hosts its store and has nobody else to wait for."""


def rendezvous_parameters(config: LaunchConfig) -> RendezvousParameters:
    """The rendezvous parameters of ``config`` (ValueError if the backend rejects an option)."""
    conf = dict(config.rdzv_conf)
    if config.standalone:
        conf = {**STANDALONE_CONF, **conf}
    return RendezvousParameters(
        config.rdzv_backend, config.rdzv_endpoint, config.run_id, config.min_nodes,
        config.max_nodes, config.local_addr, **conf,
    )


def create_handler(config: LaunchConfig) -> RendezvousHandler:
    return get_rendezvous_handler(rendezvous_parameters(config))


def launch(config: LaunchConfig) -> int:
    """Run one node of the job described by ``config``; the exit code."""
    handler = create_handler(config)
    host = config.local_addr or ("127.0.0.1" if config.standalone else None)
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
