"""The store's rules that every holder of the data applies: the in-process HashStore and the
file store through :class:`~rdzv.kv.KVState`, the store server, and the clients that check what
they send.
"""

from __future__ import annotations

from typing import Iterable, Mapping

DEFAULT_SESSION_TTL = 15.0
"""Seconds without a heartbeat after which a client's ephemeral keys are removed."""


def compare_set_result(current: bytes | None, expected: bytes, desired: bytes) -> tuple[bytes, bool]:
    """torch's compare_set rule: returns (result, whether to write ``desired``).

    A missing key is written only when ``expected`` is empty; a present key only when it equals
    ``expected``. The result is ``desired`` when written; otherwise the current value, or
    ``expected`` itself when the key is missing (as torch's TCPStore does).
    """
    if current is None:
        return (desired, True) if expected == b"" else (expected, False)
    if current == expected:
        return desired, True
    return current, False


def conditions_hold(conditions: Mapping[str, bytes | None], current: Mapping[str, bytes | None]) -> bool:
    """The rule of :meth:`Store.multi_set_if`: every condition key holds exactly its expected
    value (None: it is missing), given the ``current`` value of each (None: missing)."""
    return all(current.get(key) == expected for key, expected in conditions.items())


def dir_paths(key: str) -> Iterable[str]:
    """The paths whose watchers a change of ``key`` concerns: the key, each parent dir, ``""``."""
    yield key
    end = key.rfind("/", 0, len(key) - 1 if key.endswith("/") else len(key))
    while end >= 0:
        yield key[: end + 1]
        end = key.rfind("/", 0, end)
    yield ""
