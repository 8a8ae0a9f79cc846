"""The queue value codec (rdzv.store._queue): items round-trip, every value is unique, and any
value that is not a queue is refused by name."""

from __future__ import annotations

import pytest

from rdzv.errors import StoreValueError
from rdzv.store._queue import MAGIC, decode, encode


@pytest.mark.parametrize("items", [[], [b""], [b"a"], [b"a", b"", b"\x00" * 70000, "é".encode()]])
def test_items_round_trip(items: list[bytes]) -> None:
    assert decode("q", encode(items)) == items


def test_a_missing_or_empty_value_is_an_empty_queue() -> None:
    assert decode("q", None) == [] and decode("q", b"") == []


def test_every_value_written_is_unique() -> None:
    """What makes a won compare_set tell itself apart from another client's identical change."""
    values = {encode([b"same"]) for _ in range(1000)}
    assert len(values) == 1000


@pytest.mark.parametrize(
    "value",
    [b"1", b"plain text", MAGIC, MAGIC + b"\x00" * 15,
     encode([b"abc"])[:-1],  # an item cut short
     encode([]) + b"\x05\x00",  # a length cut short
     encode([]) + b"\xff\xff\xff\xff"],  # a length past the end
    # fixed ids: encode() adds random bytes, and every pytest-xdist worker must collect the same
    ids=["number", "text", "magic only", "magic and nonce", "item cut short",
         "length cut short", "length past the end"],
)
def test_a_value_that_is_not_a_queue_is_refused(value: bytes) -> None:
    with pytest.raises(StoreValueError, match="key 'q' holds a value that is not a queue"):
        decode("q", value)
