"""The ``rdzv`` command: builds the parser from the sub-command modules and dispatches to them.

Each sub-command lives in its own module exposing ``register(subparsers)``, which adds its parser
and sets ``func(args) -> int``. Modules are imported only when the command line is parsed, so
``import rdzv`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from .._version import __version__
from ._hints import HintingParser, parse_command_line

SUBCOMMAND_MODULES = ("_serve", "_run", "_status")
"""Sub-command modules of this package, in the order ``rdzv --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = HintingParser(
        prog="rdzv",
        description="Rendezvous for elastic distributed training.",
    )
    parser.add_argument("--version", action="version", version=f"rdzv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")  # HintingParsers too
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``rdzv`` command line; returns the process exit code."""
    parser = build_parser()
    args = parse_command_line(parser, argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)
