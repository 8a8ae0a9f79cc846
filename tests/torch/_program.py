"""What the test programs under ``rdzv run`` share: their end (a last check, the group left,
rank 0's last line) and their exit without torch's destructors."""

from __future__ import annotations

import os
import sys
from typing import Callable

import rdzv.torch


def finish(state: rdzv.torch.ElasticState, train: Callable[[], None],
           check: Callable[[rdzv.torch.ElasticState], None]) -> None:
    """Run the training loop (``state.run``); then, unless the node left, check the state once
    more, leave the group, and rank 0 says how many steps were done."""
    state.run(train)
    if state.left:
        return
    check(state)
    rdzv.torch.destroy_process_group()  # a barrier, then torch's (see its docstring)
    if state.rank == 0:
        print(f"done: {state.step} steps", flush=True)


def run(main: Callable[[], None]) -> None:
    """Run ``main`` and exit at once: no torch destructors at exit (see
    rdzv.torch.destroy_process_group)."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
