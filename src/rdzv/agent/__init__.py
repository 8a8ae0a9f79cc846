"""The elastic agent behind ``rdzv run``: rendezvous, worker processes, restarts, error reports.

Workers use :func:`record` to have their traceback shown in the agent's failure summary. The
agent itself is imported on first use (``rdzv.agent.ElasticAgent``), so a worker's
``from rdzv.agent import record`` costs only the error report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ._errors import record

if TYPE_CHECKING:
    from ._agent import ElasticAgent
    from ._config import LaunchConfig, config_from_args
    from ._flags import ConfigError, add_run_arguments, parse_rdzv_conf
    from ._launch import launch, run_from_args
    from ._round import wait_until_others_left

_EXPORTS = {
    "ConfigError": "._flags",
    "ElasticAgent": "._agent",
    "LaunchConfig": "._config",
    "add_run_arguments": "._flags",
    "config_from_args": "._config",
    "launch": "._launch",
    "parse_rdzv_conf": "._flags",
    "run_from_args": "._launch",
    "wait_until_others_left": "._round",
}

__all__ = [
    "ConfigError",
    "ElasticAgent",
    "LaunchConfig",
    "add_run_arguments",
    "config_from_args",
    "launch",
    "parse_rdzv_conf",
    "record",
    "run_from_args",
    "wait_until_others_left",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
