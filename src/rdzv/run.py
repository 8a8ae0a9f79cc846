"""``python -m rdzv.run``: the same as ``rdzv run`` (a drop-in for ``python -m torch.distributed.run``)."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from .agent import add_run_arguments, run_from_args
from .cli._hints import HintingParser
from .cli._run import SCRIPT_ARGS_NOTE


def main(argv: Sequence[str] | None = None) -> int:
    parser = HintingParser(
        prog="python -m rdzv.run",
        description="Launch the workers of one node of an elastic job (torchrun's flags).",
        allow_abbrev=False,
        unknown_note=SCRIPT_ARGS_NOTE,
    )
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
