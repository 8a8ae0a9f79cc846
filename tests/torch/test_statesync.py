"""A training state sent from one process to another over gloo, without pickle."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from _launcher import PYTHON, free_port

from rdzv.torch._statesync import _decode, _encode

PEER = str(Path(__file__).resolve().parent / "_statesync_peer.py")


def test_two_processes_end_with_the_same_model_and_optimizer() -> None:
    port = str(free_port())
    peers = [subprocess.Popen([PYTHON, PEER, str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    for peer in peers:
        out, err = peer.communicate(timeout=120)
        assert peer.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1]


def test_the_tree_keeps_its_shape_and_refuses_what_json_cannot_carry() -> None:
    tensor = torch.arange(3)
    tree = {"a": [1, (2.5, None)], 0: {"t": tensor}, "s": "x", True: False}
    tensors: list[torch.Tensor] = []
    decoded = _decode(_encode(tree, tensors), tensors)
    assert decoded["a"] == [1, (2.5, None)] and decoded[True] is False and decoded["s"] == "x"
    assert torch.equal(decoded[0]["t"], tensor)
    with pytest.raises(TypeError, match="cannot send a set in the training state"):
        _encode({"bad": {1, 2}}, [])
    with pytest.raises(TypeError, match="a state key must be a string or a number"):
        _encode({(1, 2): 3}, [])
