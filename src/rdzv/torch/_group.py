"""A worker's side of in-process changes, below :class:`ElasticState`: its connection to its
agent, and creating (or joining) a process group under a round's own store prefix."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from .._channel import ENV_CHANNEL, ENV_JOIN, ChannelClient
from ..errors import RendezvousParameterError
from ._abort import GroupSockets

LISTEN_POLL = 0.002
"""Seconds between a newcomer's or survivor's attempts to reach the new group's store."""
STORE_TIMEOUT = timedelta(minutes=5)
"""How long the new group's store waits for its members (the agents' switch timeout is lower)."""

group_sockets = GroupSockets()
"""The sockets of this process's current group (to abort it when a peer is lost)."""
group_options: dict[str, Any] = {"timeout": timedelta(minutes=10), "kwargs": {}}
"""How ``init_process_group`` was called (timeout, other keywords such as ``device_id``): every
group this worker creates or joins in-process is made the same way."""


class AgentListener(Protocol):
    def on_agent(self, message: dict[str, Any]) -> None: ...


class AgentLink:
    """This worker's connection to its agent, shared by init and :class:`ElasticState`.

    Messages that arrive before a listener is attached wait for it (a newcomer's agent may
    answer before the state exists)."""

    def __init__(self, path: str) -> None:
        self._listener: AgentListener | None = None
        self._early: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.client = ChannelClient(path, int(os.environ.get("LOCAL_RANK", "0")), self._on)

    def _on(self, message: dict[str, Any]) -> None:
        with self._lock:
            listener = self._listener
            if listener is None:
                self._early.append(message)
                return
        listener.on_agent(message)

    def attach(self, listener: AgentListener) -> None:
        with self._lock:
            self._listener, early, self._early = listener, self._early, []
        for message in early:
            listener.on_agent(message)

    def send(self, message: dict[str, Any]) -> None:
        self.client.send(message)


_link: AgentLink | None = None


def agent_link() -> AgentLink | None:
    """The connection to this worker's rdzv agent (None when not started by ``rdzv run``)."""
    global _link
    path = os.environ.get(ENV_CHANNEL)
    if _link is None and path:
        _link = AgentLink(path)
    return _link


def group_store(addr: str, port: int, rank: int, world_size: int) -> dist.Store:
    """The TCPStore of a group created in-process (global rank 0 serves it, starting it when it
    gets the plan, as the others do: they wait for it to listen first, since torch's client
    backs off for about 0.4 s when its first connection is refused)."""
    if rank != 0:
        _wait_listening(addr, port, STORE_TIMEOUT.total_seconds())
    return dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=STORE_TIMEOUT,
                         wait_for_workers=False)


def _wait_listening(addr: str, port: int, timeout: float) -> None:
    """Return once ``addr:port`` accepts connections (or after ``timeout``: torch's client then
    reports the failure in its own words)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), timeout=min(1.0, timeout)).close()
            return
        except OSError:
            time.sleep(LISTEN_POLL)


def init_group(backend: str, store: dist.Store, prefix: str, rank: int, world_size: int) -> None:
    """Start the default process group on ``store`` under the round's own ``prefix``, as the
    worker's first one was (``group_options``)."""
    with group_sockets.recording():
        dist.init_process_group(backend, store=dist.PrefixStore(f"{prefix}/", store), rank=rank,
                                world_size=world_size, timeout=group_options["timeout"],
                                **group_options["kwargs"])


def join_running_group(backend: str) -> tuple[int, int]:
    """A newcomer's start: tell the agent it is up (warm), then wait in the new group's
    creation until the running workers switch to it."""
    if agent_link() is None:
        raise RendezvousParameterError(
            f"{ENV_JOIN} is set but {ENV_CHANNEL} is not: both come from `rdzv run`; do not "
            "set them by hand")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = group_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank,
                        world_size)
    init_group(backend, store, os.environ[ENV_JOIN], rank, world_size)
    return rank, world_size
