"""``rdzv run``: launch the workers of one node of an elastic job (torchrun's flags)."""

from __future__ import annotations

import argparse
from typing import Any

SCRIPT_ARGS_NOTE = "arguments of the training script go after TRAINING_SCRIPT"
"""Said when ``rdzv run`` meets an unknown flag that looks like none of its own."""


def register(subparsers: Any) -> None:
    """Add the ``run`` sub-command."""
    from ..agent import add_run_arguments, run_from_args

    parser = subparsers.add_parser(
        "run",
        help="launch the workers of one node of an elastic job (torchrun's flags)",
        description="Join the rendezvous, start --nproc-per-node workers with torch's env "
                    "(RANK, WORLD_SIZE, MASTER_ADDR...), restart them on failure or when nodes "
                    "join or leave. Example: rdzv run --standalone --nproc-per-node 2 train.py",
        allow_abbrev=False,
        unknown_note=SCRIPT_ARGS_NOTE,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_run_arguments(parser)
    parser.set_defaults(func=run_from_args)
