"""How the workers of a new group agree on one state (``rdzv/torch/_agreement.py``): the rule as
a table, and the digest of real model and optimizer states."""

from __future__ import annotations

import pytest
import torch

from rdzv.torch._agreement import Holding, agree, divergent, state_digest
from rdzv.torch._statesync import encode_tree

A, B = (1, 2, 3), (7, 8, 9)
FRESH = Holding(0, True, (0, 0, 0))


def at(step: int, digest: tuple[int, int, int] = A) -> Holding:
    return Holding(step, False, digest)


ROWS = [
    ("a planned switch: rank 0 sends to the newcomer only",
     [at(50), at(50), FRESH], 0, (0, [2])),
    ("the decided source is kept when it is among the most advanced",
     [at(50), at(50), FRESH], 1, (1, [2])),
    ("a recovery: survivors one step apart adopt the most advanced (a complete step is kept)",
     [at(41, B), at(40), at(41, B)], 0, (0, [1])),
    ("the agents' view was a moment old: the most advanced rank is the source",
     [at(40), at(41, B)], 0, (1, [0])),
    ("a worker that missed a step (it thought itself ahead) is brought into agreement",
     [at(60), at(59, B), at(60)], 1, (0, [1])),
    ("a divergence (two states at one step): the source's wins, the other receives it",
     [at(50), at(50, B), at(50)], 0, (0, [1])),
    ("nobody holds a state: every worker starts from its checkpoint",
     [FRESH, FRESH], None, (None, [])),
    ("every worker already holds the same state: nothing moves",
     [at(50), at(50)], None, (0, [])),
]


@pytest.mark.parametrize(("holdings", "decided", "expected"), [row[1:] for row in ROWS],
                         ids=[row[0] for row in ROWS])
def test_agree(holdings: list[Holding], decided: int | None,
               expected: tuple[int | None, list[int]]) -> None:
    assert agree(holdings, decided) == expected


def test_a_divergence_is_named() -> None:
    assert divergent([at(50), at(50, B), at(49, B), FRESH], 0) == [1]


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
