"""Store queues (torch's ``queue_push``, ``queue_pop``, ``queue_len``) for every store, built on
``compare_set``.

A queue lives in the value of its key: a header (a magic string and 16 random bytes, fresh in
every value written) followed by the items, each as ``u32`` length + bytes. Every change is one
``compare_set`` from the exact value read to the new one. Because each value written is unique
(its random bytes), a ``compare_set`` that returns its desired value has made the change, and
one that returns anything else lost to another client's change: it reads again and retries.
So a push never loses an item and two poppers never take the same one, on every store whose
``compare_set`` is atomic (all of rdzv's), across processes and hosts.

A blocking pop reads the key's revision before its value and, while the queue is empty, watches
the key from that revision: the push that fills the queue wakes it (server-side on TCPStore and
etcd, by polling on a FileStore). It gives up after the store's timeout with the store's timeout
error, naming the key.

The encoding and the decisions are pure functions; :func:`push`, :func:`pop` and :func:`length`
run them against a store.
"""

from __future__ import annotations

import os
import struct
import time
from typing import TYPE_CHECKING

from ..errors import QueueEmptyError, StoreTimeoutError, StoreValueError

if TYPE_CHECKING:
    from ._base import Store

MAGIC = b"rdzv-queue\x00"
"""How a queue's value starts."""
_NONCE_SIZE = 16
_HEADER_SIZE = len(MAGIC) + _NONCE_SIZE
_LEN = struct.Struct("<I")


def encode(items: list[bytes]) -> bytes:
    """A queue value holding ``items`` (first to be popped first), unique to this call."""
    pack = _LEN.pack
    return MAGIC + os.urandom(_NONCE_SIZE) + b"".join(pack(len(item)) + item for item in items)


def decode(key: str, value: bytes | None) -> list[bytes]:
    """The items of the queue value ``value`` of ``key`` (missing or empty: no items).

    Raises:
        StoreValueError: ``key`` holds a value that is not a queue (set by ``set`` or ``add``).
    """
    if not value:
        return []
    if not value.startswith(MAGIC) or len(value) < _HEADER_SIZE:
        raise _not_a_queue(key, value)
    items, pos, end = [], _HEADER_SIZE, len(value)
    while pos < end:
        if pos + 4 > end:
            raise _not_a_queue(key, value)
        (size,) = _LEN.unpack_from(value, pos)
        pos += 4
        if pos + size > end:
            raise _not_a_queue(key, value)
        items.append(value[pos : pos + size])
        pos += size
    return items


def _not_a_queue(key: str, value: bytes) -> StoreValueError:
    return StoreValueError(
        f"key {key!r} holds a value that is not a queue ({value[:20]!r}...): it was written by "
        "set/add/append; use another key for the queue (or delete this one first)"
    )


def push(store: "Store", key: str, value: bytes) -> None:
    """Append ``value`` to the queue at ``key``."""
    deadline = time.monotonic() + store.timeout.total_seconds()
    while True:
        current = store.try_get(key)
        desired = encode(decode(key, current) + [value])
        if store.compare_set(key, current or b"", desired) == desired:
            return
        _check_progress(key, deadline, "push to")


def pop(store: "Store", key: str, block: bool) -> bytes:
    """Take the first item of the queue at ``key``; wait for one (up to the store's timeout)
    when ``block``, else raise QueueEmptyError if there is none."""
    seconds = store.timeout.total_seconds()
    deadline = time.monotonic() + seconds
    while True:
        reads = store.read_many(keys=[key], revisions=[key])
        current, revision = reads.values[key], reads.revisions[key]
        items = decode(key, current)
        if items:
            desired = encode(items[1:])
            if store.compare_set(key, current or b"", desired) == desired:
                return items[0]
            _check_progress(key, deadline, "pop from")
            continue
        if not block:
            raise QueueEmptyError(f"queue is empty (key {key!r})")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreTimeoutError.waiting_for([key], seconds)
        store.watch(key, revision, remaining)


def length(store: "Store", key: str) -> int:
    """How many items the queue at ``key`` holds (0 if it does not exist)."""
    return len(decode(key, store.try_get(key)))


def _check_progress(key: str, deadline: float, what: str) -> None:
    """After a lost compare_set: go on retrying until the store's timeout (each loss means
    another client's change went through, so the store as a whole makes progress)."""
    if time.monotonic() >= deadline:
        raise StoreTimeoutError(
            f"timeout: could not {what} the queue {key!r} within the store's timeout: other "
            "clients changed it first every time",
            (key,),
        )
