"""What one node's run asks of its agent: the narrow face that :class:`~._node.NodeRun`, its
crew, health checks and console of forming rounds see (:class:`~._agent.ElasticAgent` is one).

The run's parts never reach into the agent beyond this: its configuration and rendezvous, the
console, the queue their events go to, and the making, starting and reporting of worker groups.
"""

from __future__ import annotations

import queue
from typing import Any, Protocol

from .._clock import Clock
from ..rendezvous import RendezvousHandler
from ._config import LaunchConfig
from ._errors import WorkerFailure
from ._records import Assignment
from ._workers import WorkerGroup


class NodeHost(Protocol):
    """The agent as one node's run sees it."""

    config: LaunchConfig
    handler: RendezvousHandler
    host: str
    """This node's address (the workers' MASTER_ADDR, the failure reports)."""
    started: float
    """When the agent started (wall time)."""
    events: queue.SimpleQueue[Any]
    """Where the workers' exits, their messages and signals are posted."""
    store_gone: bool
    """Set by the run when the rendezvous store could not be reached for its whole timeout."""
    signals: int
    """How many signals the agent received so far."""
    clock: Clock
    """The time the run's decisions are taken at (tests move it)."""

    def say(self, message: str) -> None:
        """Tell the person at the console what happens."""

    def describe(self, assignment: Assignment) -> str:
        """This node's place in a round, in words."""

    def new_group(self, generation: int) -> WorkerGroup:
        """An empty worker group whose exits are tagged ``generation``."""

    def start_workers(self, group: WorkerGroup, local_ranks: list[int],
                      assignment: Assignment | None, restarts: int, channel_path: str,
                      together: str | None = None) -> None:
        """Start the workers ``local_ranks`` in ``group``, speaking on ``channel_path``
        (``together``: joiners set up in one provisional group, through that file)."""

    def failure(self, group: WorkerGroup, local_rank: int, code: int) -> WorkerFailure:
        """What is known of a worker that failed."""
