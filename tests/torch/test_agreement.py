"""How the workers of a new group agree on one state (``rdzv/torch/_agreement.py``): the rule as
a table, and the digest of real model and optimizer states."""

from __future__ import annotations

import pytest
import torch

from rdzv.errors import RendezvousStateError
from rdzv.torch._agreement import Agreement, Holding, agree, divergent, state_digest
from rdzv.torch._statesync import encode_tree

A, B = (1, 2, 3), (7, 8, 9)
FRESH = Holding(0, True, (0, 0, 0))


def at(step: int, digest: tuple[int, int, int] = A) -> Holding:
    return Holding(step, False, digest)


C, D = (4, 5, 6), (10, 11, 12)
"""Digests of the other part of a state split over a node's two workers."""


def one(source: int | None, receivers: list[int]) -> Agreement:
    """The agreement of workers that each hold the whole state."""
    return Agreement() if source is None else Agreement((source,), (tuple(receivers),))


ROWS = [
    ("a planned switch: rank 0 sends to the newcomer only",
     [at(50), at(50), FRESH], 0, 1, one(0, [2])),
    ("the decided source is kept when it is among the most advanced",
     [at(50), at(50), FRESH], 1, 1, one(1, [2])),
    ("a recovery: survivors one step apart adopt the most advanced (a complete step is kept)",
     [at(41, B), at(40), at(41, B)], 0, 1, one(0, [1])),
    ("the agents' view was a moment old: the most advanced rank is the source",
     [at(40), at(41, B)], 0, 1, one(1, [0])),
    ("a worker that missed a step (it thought itself ahead) is brought into agreement",
     [at(60), at(59, B), at(60)], 1, 1, one(0, [1])),
    ("a divergence (two states at one step): the source's wins, the other receives it",
     [at(50), at(50, B), at(50)], 0, 1, one(0, [1])),
    ("nobody holds a state: every worker starts from its checkpoint",
     [FRESH, FRESH], None, 1, one(None, [])),
    ("every worker already holds the same state: nothing moves",
     [at(50), at(50)], None, 1, one(0, [])),
    # sharded (HSDP): each node's two workers hold parts 0 and 1 of the state
    ("sharded, a node joins: each of its workers receives its part from the same node",
     [at(50, A), at(50, C), FRESH, FRESH], 0, 2, Agreement((0, 1), ((2,), (3,)))),
    ("sharded, the decided node is the source, every part from it",
     [at(50, A), at(50, C), at(50, A), at(50, C), FRESH, FRESH], 2, 2,
     Agreement((2, 3), ((4,), (5,)))),
    ("sharded, a recovery: the node one step ahead on both parts is the source",
     [at(40, B), at(40, D), at(41, A), at(41, C)], 0, 2, Agreement((2, 3), ((0,), (1,)))),
    ("sharded, a node that applied a step on one part only is no source: it is brought back",
     [at(41, A), at(40, D), at(40, B), at(40, D)], 0, 2, Agreement((2, 3), ((0,), ()))),
    ("sharded, a node with a restarted worker is no source: the fresh one receives",
     [at(50, A), FRESH, at(50, A), at(50, C)], 0, 2, Agreement((2, 3), ((), (1,)))),
    ("sharded, nobody holds a state",
     [FRESH, FRESH, FRESH, FRESH], None, 2, Agreement()),
]


@pytest.mark.parametrize(("holdings", "decided", "shards", "expected"),
                         [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_agree(holdings: list[Holding], decided: int | None, shards: int,
               expected: Agreement) -> None:
    assert agree(holdings, decided, shards) == expected


def test_a_divergence_is_named() -> None:
    holdings = [at(50), at(50, B), at(49, B), FRESH]
    assert divergent(holdings, agree(holdings, 0)) == [1]


def test_no_whole_state_anywhere_is_an_error_not_a_mix() -> None:
    with pytest.raises(RendezvousStateError, match="no node holds every part"):
        agree([at(41, A), at(40, D), at(41, B), at(40, C)], 0, 2)


def test_nodes_must_run_as_many_workers() -> None:
    with pytest.raises(RendezvousStateError, match="every node must run as many workers"):
        agree([at(1), at(1), at(1)], 0, 2)


def model_state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    return {"step": 5, "values": {}, "model": dict(model.state_dict()),
            "optimizer": optimizer.state_dict()}


def test_equal_states_have_equal_digests_and_any_change_shows() -> None:
    digest = state_digest(*encode_tree(model_state(0)))
    assert state_digest(*encode_tree(model_state(0))) == digest
    assert state_digest(*encode_tree(model_state(1))) != digest
    changed = model_state(0)
    weight = changed["model"]["0.weight"]  # type: ignore[index]
    weight[3, 4] = torch.nextafter(weight[3, 4], torch.tensor(1.0))  # one bit of one value
    assert state_digest(*encode_tree(changed)) != digest
    swapped = model_state(0)
    bias = swapped["model"]["0.bias"]  # type: ignore[index]
    bias[[0, 1]] = bias[[1, 0]].clone()  # two values trade places
    assert state_digest(*encode_tree(swapped)) != digest
    later = {**model_state(0), "step": 6}
    assert state_digest(*encode_tree(later)) != digest
