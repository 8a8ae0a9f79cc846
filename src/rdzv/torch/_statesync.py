"""Moving a training state from one worker to others over the process group, without pickle.

A state is a tree of dicts, lists and tuples with tensors, numbers, strings, booleans and None
as leaves (what ``state_dict()`` of modules and optimizers holds). It travels as a JSON header
describing the tree, every tensor replaced by its index, dtype and shape, followed by the
tensors themselves: each large one on its own, the small ones packed into one buffer per dtype
so that an optimizer's hundreds of scalars cost a few messages, not hundreds.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..errors import RendezvousStateError

FORMAT = 1
PACK_LIMIT = 1 << 20
"""Tensors smaller than this many bytes travel packed together with others of their dtype."""


def _encode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        tensors.append(node.detach().contiguous())
        return {"T": len(tensors) - 1}
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise TypeError(f"a state key must be a string or a number, not {key!r}")
        return {"D": [[key, _encode(value, tensors)] for key, value in node.items()]}
    if isinstance(node, (list, tuple)):
        return {"L" if isinstance(node, list) else "U": [_encode(v, tensors) for v in node]}
    if node is None or isinstance(node, (str, int, float, bool)):
        return node
    raise TypeError(f"cannot send a {type(node).__name__} in the training state: tensors, "
                    "numbers, strings, None, lists, tuples and dicts only")


def encode_tree(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """``tree`` as its JSON skeleton (each tensor replaced by its index) and its tensors."""
    tensors: list[torch.Tensor] = []
    return _encode(tree, tensors), tensors


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    if "T" in node:
        return tensors[node["T"]]
    if "D" in node:
        return {key: _decode(value, tensors) for key, value in node["D"]}
    listed = "L" in node
    items = [_decode(value, tensors) for value in node["L" if listed else "U"]]
    return items if listed else tuple(items)


def _packs(meta: list[tuple[str, list[int]]]) -> Iterator[list[int]]:
    """The indices of the tensors of each message: large ones alone, small ones by dtype."""
    small: dict[str, list[int]] = {}
    for index, (dtype, shape) in enumerate(meta):
        size = _dtype(dtype).itemsize * _numel(shape)
        if size >= PACK_LIMIT:
            yield [index]
        else:
            small.setdefault(dtype, []).append(index)
    yield from small.values()


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RendezvousStateError(f"unknown tensor dtype {name!r} in a received state")
    return dtype


def send_state(tree: Any, destinations: list[int], device: torch.device) -> int:
    """Send ``tree`` to each global rank of ``destinations``; the bytes sent to each."""
    skeleton, tensors = encode_tree(tree)
    header = {"format": FORMAT, "tree": skeleton,
              "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    length = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    blob = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    messages = []
    for pack in _packs(header["tensors"]):
        if len(pack) == 1:
            messages.append(tensors[pack[0]].reshape(-1).to(device))
        else:
            messages.append(torch.cat([tensors[i].reshape(-1) for i in pack]).to(device))
    sent = len(raw) + sum(m.numel() * m.element_size() for m in messages)
    for destination in destinations:
        dist.send(length, destination)
        dist.send(blob, destination)
        for message in messages:
            dist.send(message, destination)
    return sent


def receive_state(source: int, device: torch.device) -> Any:
    """The tree that global rank ``source`` sends with :func:`send_state`."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, source)
    blob = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(blob, source)
    try:
        host = blob.cpu().contiguous()
        header = json.loads(ctypes.string_at(host.data_ptr(), host.numel()))
    except ValueError as exc:
        raise RendezvousStateError(f"the state received from rank {source} has a malformed "
                                   "header") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise RendezvousStateError(f"the state received from rank {source} is of another "
                                   f"format ({header.get('format') if isinstance(header, dict) else '?'};"
                                   f" this worker reads {FORMAT}): run one rdzv version")
    meta = [(str(dtype), [int(d) for d in shape]) for dtype, shape in header["tensors"]]
    tensors: list[torch.Tensor] = [torch.empty(0)] * len(meta)
    for pack in _packs(meta):
        dtype = _dtype(meta[pack[0]][0])
        sizes = [_numel(meta[i][1]) for i in pack]
        buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.recv(buffer, source)
        for index, part in zip(pack, torch.split(buffer, sizes)):
            tensors[index] = part.reshape(meta[index][1])
    return _decode(header["tree"], tensors)
