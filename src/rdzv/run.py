"""``python -m rdzv.run``: the same as ``rdzv run`` (a drop-in for ``python -m torch.distributed.run``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn, Sequence

from .agent import add_run_arguments, run_from_args
from .agent._config import unknown_flag_hint


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        super().error(message + unknown_flag_hint(message, self))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(
        prog="python -m rdzv.run",
        description="Launch the workers of one node of an elastic job (torchrun's flags).",
        allow_abbrev=False,
    )
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
