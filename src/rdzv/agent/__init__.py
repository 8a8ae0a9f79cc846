"""The elastic agent behind ``rdzv run``: rendezvous, worker processes, restarts, error reports.

Workers use :func:`record` to have their traceback shown in the agent's failure summary.
"""

from ._agent import ElasticAgent
from ._config import LaunchConfig, config_from_args
from ._errors import record
from ._flags import ConfigError, add_run_arguments, parse_rdzv_conf
from ._launch import launch, run_from_args
from ._round import wait_until_others_left

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
