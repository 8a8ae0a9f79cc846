"""How the workers of a new group come to hold one state: each says what it holds (its step, and
a digest of its state), and all follow the same rule (:func:`agree`).

Every worker entering a group all-gathers one small tensor: its completed steps, whether it is
fresh (a newcomer without state), and a digest of its state. The decision of its agents names
the source (the survivor with the most steps); :func:`agree` keeps it when it holds the most
advanced state, else takes the lowest rank that does (the agents' view of the steps can be a
moment old), and every worker whose step or digest differs from the source's receives the
source's state. After the transfer the receivers' digests are gathered again and must all equal
the source's: no group trains on with parameters that differ, and a worker whose view disagreed
(it thought itself ahead, it missed a step) is brought into agreement by receiving the state.

The digest (:func:`state_digest`) sums every tensor's bytes as 64-bit integers (wrapping), so
equal states give equal digests whatever the order of the reduction (threads, devices), plus a
sum over a strided sample (values that trade places change it) and a hash of everything else in
the state (step, values, the tree's shapes and dtypes). Cost: one pass over the state at memory
speed, measured in ``bench/membership.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import RendezvousStateError
from ._group import GroupLost
from ._statesync import encode_tree, receive_state, send_state

logger = logging.getLogger(__name__)

MASK = (1 << 64) - 1
STRIDE = 97
"""The sample of every 97th word that makes the digest change when values move."""
MIX = 0x9E3779B97F4A7C15
"""An odd 64-bit constant: tensor i's sums are weighted by MIX**(i+1), so that values moving
between tensors change the digest."""


class StateMismatch(RendezvousStateError):
    """The workers of a group cannot be brought to one state: the message says why, for the
    worker's error; ``report`` in a line, for its agent; ``misfit``: this worker cannot hold
    the state it received (its program is not the job's), rather than the group's states
    being beyond agreement."""

    def __init__(self, message: str, report: str, misfit: bool = False) -> None:
        super().__init__(message)
        self.report = report
        self.misfit = misfit


@dataclass(frozen=True)
class Holding:
    """What one worker holds as it enters a group."""

    step: int
    fresh: bool
    digest: tuple[int, int, int]


@dataclass(frozen=True)
class Agreement:
    """Who sends the group's state to whom: ``sources[i]`` sends shard ``i`` (the whole state
    unless the model is sharded) to ``receivers[i]``. No sources: nobody holds a state, every
    worker starts from its own (its checkpoint)."""

    sources: tuple[int, ...] = ()
    receivers: tuple[tuple[int, ...], ...] = ()

    def source_of(self, rank: int) -> int:
        """The rank whose state ``rank`` must hold (its shard's source)."""
        return self.sources[rank % len(self.sources)]

    def receivers_of(self, rank: int) -> tuple[int, ...]:
        """The ranks that receive the shard ``rank`` holds from its source."""
        return self.receivers[rank % len(self.sources)]


def agree(holdings: Sequence[Holding], decided: int | None, shards: int = 1) -> Agreement:
    """Who sends what among the workers of a group (index = global rank). Each worker holds one
    of ``shards`` parts of the state, rank ``r`` part ``r % shards``, so that node ``n`` (ranks
    ``n*shards`` to ``n*shards + shards - 1``) holds a whole copy (one part: each worker holds the
    whole state, as with DDP). The source node holds the most advanced whole state: all its
    parts at one step, the highest; ``decided``'s node if it is such, else the first. Every
    worker whose part differs from the source node's same part (or that is fresh) receives it.

    A state is whole on no node while some workers hold parts (a node's workers applied a step
    unevenly and no node holds it all): ``RendezvousStateError``, the state cannot be made one
    in memory (the workers restart from their checkpoint)."""
    if shards < 1 or len(holdings) % shards:
        raise RendezvousStateError(f"{len(holdings)} workers cannot hold {shards} parts each "
                                   "node: every node must run as many workers")
    nodes = [holdings[first:first + shards] for first in range(0, len(holdings), shards)]
    whole = [n for n, parts in enumerate(nodes) if not any(p.fresh for p in parts) and
             len({p.step for p in parts}) == 1]
    if not whole:
        if any(not h.fresh for h in holdings):
            raise RendezvousStateError(
                "no node holds every part of the state at one step (steps "
                f"{[h.step for h in holdings]}): it cannot be made one in memory")
        return Agreement()
    top = max(nodes[n][0].step for n in whole)
    best = [n for n in whole if nodes[n][0].step == top]
    chosen = decided // shards if decided is not None and decided // shards in best else best[0]
    sources = tuple(chosen * shards + part for part in range(shards))
    receivers = tuple(tuple(
        rank for rank in range(part, len(holdings), shards) if rank != source and (
            holdings[rank].fresh or (holdings[rank].step, holdings[rank].digest) !=
            (holdings[source].step, holdings[source].digest)))
        for part, source in enumerate(sources))
    return Agreement(sources, receivers)


def divergent(holdings: Sequence[Holding], agreement: Agreement) -> list[int]:
    """The ranks that held another state than their source at the source's step (a divergence
    that only a protocol error causes: they receive the source's state, but say so)."""
    odd = []
    for rank, holding in enumerate(holdings):
        want = holdings[agreement.source_of(rank)]
        if not holding.fresh and holding.step == want.step and holding.digest != want.digest:
            odd.append(rank)
    return odd


def _sums(tensor: torch.Tensor) -> tuple[int, int]:
    """(sum, strided-sample sum) of a tensor's bytes read as 64-bit integers, wrapping, so that
    the result does not depend on the order of the reduction; a tail of fewer than 8 bytes (or
    a tensor whose storage offset forbids the view) is summed byte by byte."""
    flat = tensor.detach().contiguous().reshape(-1)
    raw = (flat.to(torch.uint8) if flat.dtype == torch.bool else flat).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # a view into a buffer at an unaligned offset
        words = raw[:whole].clone().view(torch.int64)
    tail = int(raw[whole:].sum(dtype=torch.int64).item()) if whole < raw.numel() else 0
    total = int(words.sum().item()) if whole else 0
    sample = int(words[::STRIDE].sum().item()) if whole else 0
    return (total + tail * MIX) & MASK, sample & MASK


def state_digest(tree: Any, tensors: list[torch.Tensor]) -> tuple[int, int, int]:
    """A digest of a state: ``tree`` is its JSON-able skeleton (tensors replaced by their
    index), ``tensors`` its tensors (as :func:`._statesync.encode_tree` gives them)."""
    skeleton = json.dumps([tree, [[str(t.dtype), list(t.shape)] for t in tensors]],
                          separators=(",", ":"), sort_keys=True, default=str)
    head = int.from_bytes(hashlib.blake2b(skeleton.encode(), digest_size=8).digest(), "little")
    total = sample = 0
    weight = 1
    for tensor in tensors:
        weight = (weight * MIX) & MASK
        if tensor.numel() == 0:
            continue
        whole, strided = _sums(tensor)
        total = (total + weight * whole) & MASK
        sample = (sample + weight * strided) & MASK
    return head, total, sample


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def gather_holdings(step: int, fresh: bool, digest: tuple[int, int, int],
                    device: torch.device) -> list[Holding]:
    """Every worker's holding in the current group (one all_gather of 5 int64 per worker)."""
    mine = torch.tensor([step, int(fresh), *(_signed(d) for d in digest)], dtype=torch.int64,
                        device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    holdings = []
    for row in (t.cpu().tolist() for t in everyone):
        step, fresh_flag, d0, d1, d2 = (int(v) for v in row)
        holdings.append(Holding(step, bool(fresh_flag), (d0 & MASK, d1 & MASK, d2 & MASK)))
    return holdings


@dataclass(frozen=True)
class Reached:
    """How one worker came to hold its group's state."""

    received: bool
    """It received the state from its source (else it held it already, or nobody holds one)."""
    agreed: float
    """When the group last agreed on it (``time.perf_counter()``)."""


def _digest(tree: Any) -> tuple[int, int, int]:
    return state_digest(*encode_tree(tree))


def reach_one_state(step: int, fresh: bool, decided: int | None, *,
                    tree: Callable[[], Any], load: Callable[[Any], int], shards: int,
                    device: torch.device) -> Reached:
    """Bring every worker of the current group to one state (a collective of the group): gather
    the holdings, follow :func:`agree` (``decided``: the agents' source; ``shards``: the parts
    each node holds), send the source's state (``tree()``) to the workers that hold another,
    which ``load`` it (returning its step), and compare the digests again. ``StateMismatch``
    when no state can be agreed on, or this worker, or a receiver that held a state, still
    differs from its source; ``GroupLost`` on the others when only newcomers differ (their
    program cannot hold the job's state: they leave, and the group recovers without them)."""
    holdings = gather_holdings(step, fresh, (0, 0, 0) if fresh else _digest(tree()), device)
    try:
        agreement = agree(holdings, decided, shards)
    except RendezvousStateError as exc:
        raise StateMismatch(f"the group cannot agree on one state: {exc}", str(exc)) from exc
    if not agreement.sources or not any(agreement.receivers):
        return Reached(False, time.perf_counter())
    odd = divergent(holdings, agreement)
    if odd:
        sources = agreement.sources
        named = f"rank {sources[0]}" if len(sources) == 1 else f"their sources (ranks {sources})"
        logger.warning("ranks %s held other parameters than %s at step %d: they receive its "
                       "state", odd, named, step)
    me = dist.get_rank()  # in the new group (this worker's rank changes with it)
    source = agreement.source_of(me)
    receivers = list(agreement.receivers_of(me))
    received = me in receivers
    digest = holdings[me].digest
    if me == source and receivers:
        sent = send_state(tree(), receivers, device)
        logger.info("sent %d bytes of state to ranks %s", sent, receivers)
    elif received:
        step = load(receive_state(source, device))
        digest = _digest(tree())
    after = gather_holdings(step, False, digest, device)
    differ = [rank for rank, h in enumerate(after) if (h.step, h.digest) != (
        after[agreement.source_of(rank)].step, after[agreement.source_of(rank)].digest)]
    if differ and me not in differ and all(holdings[rank].fresh for rank in differ):
        raise GroupLost(f"newcomer ranks {differ} cannot hold the job's state (another "
                        "program?): the group goes on without them")
    if differ:
        raise StateMismatch(
            f"ranks {differ} still hold another state than their source (ranks "
            f"{agreement.sources}) after receiving it (before: {holdings}; after: {after}): is "
            "every node running the same program?",
            f"ranks {differ} hold another state than their source (ranks {agreement.sources}) "
            "after receiving it", misfit=me in differ)
    return Reached(received, time.perf_counter())
