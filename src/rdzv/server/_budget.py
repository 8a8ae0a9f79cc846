"""The server's memory budget: how many bytes it may buffer for its clients, all together.

A connection buffers a request until it has it whole (the frame's full length counts from its
first bytes: announced, it will be held) and the answers its client has not taken yet. Each
connection's limits (a frame at most ``--max-frame-size``, answers paused past that plus 1 MiB)
bound one client; this bounds them all: the budget covers every connection's buffers of
:data:`TRACK_MIN` bytes or more, and, for ``rdzv serve`` (a process of its own), the server's
memory when it started (interpreter, recovered data) as well, and a quarter of it is kept for
what is not counted (data written since, copies in flight, the allocator's slack). Once they would exceed it, the largest holders are shed (:func:`shed_order`),
which may be the connection whose request or answers just grew; the others keep being served.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Generic, Hashable, Mapping, TypeVar

DEFAULT_MEMORY_BUDGET = 512 << 20
"""The default budget (``--memory-budget``): 512 MiB."""
TRACK_MIN = 64 << 10
"""A connection's buffers count once they reach this many bytes (smaller ones are noise)."""

K = TypeVar("K", bound=Hashable)


def shed_order(holdings: Mapping[K, int], limit: int) -> list[K]:
    """Whom to drop so that what the others hold fits in ``limit`` bytes: the largest holders
    first, among equal ones the latest to have grown (last in ``holdings``) first; [] if it fits."""
    total = sum(holdings.values())
    victims: list[K] = []
    if total <= limit:
        return victims
    newest_first = list(holdings.items())[::-1]
    for key, amount in sorted(newest_first, key=lambda item: item[1], reverse=True):
        victims.append(key)
        total -= amount
        if total <= limit:
            break
    return victims


def resident_bytes() -> int:
    """This process's resident memory in bytes (0 where ``/proc`` does not tell)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - not Linux
        return 0


_M_MMAP_THRESHOLD = -3  # glibc's mallopt() parameter
_MMAP_FROM = 1 << 20


def _libc() -> "ctypes.CDLL | None":
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:  # pragma: no cover
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def return_freed_memory(pin: bool = False) -> None:
    """Give the memory of freed buffers back to the system now (glibc; elsewhere nothing).

    With ``pin`` (once, in a process of the server's own), blocks of 1 MiB or more are from
    then on mapped apart and returned the moment they are freed: glibc would otherwise raise
    that threshold to the size of the blocks it sees freed, and serve the next ones from a heap
    that a freed block in its middle cannot shrink (a shed client's memory kept resident).
    """
    libc = _libc()
    if libc is None:  # pragma: no cover - not glibc
        return
    if pin:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM)
    libc.malloc_trim(0)


class MemoryBudget(Generic[K]):
    """The bytes each connection (``K``) buffers, their sum, and what was shed (no I/O)."""

    def __init__(self, limit: int, base: int) -> None:
        self.limit = limit
        """The whole budget, in bytes."""
        self.base = base
        """The server's own memory when it started, in bytes (part of the budget)."""
        self.held: dict[K, int] = {}
        self.total = 0
        self.shed = 0
        """Connections dropped to keep within the budget, so far."""

    @property
    def for_buffers(self) -> int:
        """What the clients' buffers may take together."""
        return self.limit - self.limit // 4 - self.base

    def update(self, key: K, amount: int) -> list[K]:
        """``key`` now holds ``amount`` bytes (0: none); whom to shed to stay in the budget."""
        held = self.held
        self.total += amount - held.pop(key, 0)
        if amount:
            held[key] = amount  # (last: the latest to grow)
        if self.total > self.for_buffers:
            return shed_order(held, self.for_buffers)
        return []
