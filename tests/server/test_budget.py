"""The memory budget's decisions, as tables: whom to shed, and when."""

from __future__ import annotations

import pytest

from rdzv.server import StoreServer
from rdzv.server._budget import DEFAULT_MEMORY_BUDGET, MemoryBudget, shed_order
from rdzv.store import TCPStore


@pytest.mark.parametrize(
    "holdings, limit, victims",
    [
        ({}, 0, []),
        ({"a": 10, "b": 20}, 30, []),  # fits exactly
        ({"a": 10, "b": 20}, 29, ["b"]),  # the largest goes first
        ({"a": 30, "b": 20, "c": 10}, 15, ["a", "b"]),  # as many as it takes, largest first
        ({"a": 60, "b": 60, "c": 60}, 130, ["c"]),  # equals: the latest to grow goes first
        ({"a": 60, "b": 5, "c": 60}, 70, ["c"]),
        ({"a": 100}, 50, ["a"]),  # alone and too big: itself
    ],
)
def test_shed_order(holdings: dict[str, int], limit: int, victims: list[str]) -> None:
    assert shed_order(holdings, limit) == victims


def test_budget_counts_what_each_holds_and_names_whom_to_shed() -> None:
    budget: MemoryBudget[str] = MemoryBudget(limit=160, base=20)  # buffers: 160 - 40 - 20
    assert budget.for_buffers == 100
    assert budget.update("upload", 60) == []
    assert budget.update("reader", 30) == []
    assert budget.total == 90
    assert budget.update("reader", 45) == ["upload"]  # 105 > 100: the largest goes
    assert budget.update("upload", 0) == [] and budget.total == 45
    assert budget.update("other", 60) == ["other"]  # 105: the newcomer holds the most
    assert budget.update("other", 0) == [] and budget.held == {"reader": 45}


def test_a_budget_too_small_for_one_frame_is_refused() -> None:
    server = StoreServer("127.0.0.1", 0, max_frame_size=64 << 20, memory_budget=80 << 20)
    with pytest.raises(ValueError, match="not enough for one request of the maximum frame size"):
        server.start()


def test_stats_tell_the_numbers(server: StoreServer, store: TCPStore) -> None:
    store.set("k", "v")
    store.flush()
    stats = server.stats()
    assert stats == {
        "connections": 1, "sessions": 1, "keys": 1, "memory_budget": DEFAULT_MEMORY_BUDGET,
        "memory_base": 0, "buffered_bytes": 0, "buffered_input_bytes": 0,
        "buffered_output_bytes": 0, "shed_connections": 0,
    }
