"""One of two processes moving a training state with rdzv.torch._statesync (gloo, CPU)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from rdzv.torch._statesync import receive_state, send_state


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    model.big = torch.nn.Parameter(torch.randn(600_000), requires_grad=False)  # > pack limit
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model, optimizer = make(seed=rank)
    if rank == 0:
        for _ in range(3):  # the sender has optimizer state (step counts, moments)
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
        tree = {"model": dict(model.state_dict()), "optimizer": optimizer.state_dict(),
                "step": 3, "values": {"epoch": 2, "name": "x", "pair": (1, 2.5), "none": None}}
        send_state(tree, [1], torch.device("cpu"))
        fingerprint = sum(float(t.double().sum()) for t in model.state_dict().values())
    else:
        tree = receive_state(0, torch.device("cpu"))
        model.load_state_dict(tree["model"])
        optimizer.load_state_dict(tree["optimizer"])
        fingerprint = sum(float(t.double().sum()) for t in model.state_dict().values())
        assert tree["values"] == {"epoch": 2, "name": "x", "pair": (1, 2.5), "none": None}
        assert tree["step"] == 3
        assert all(int(s["step"]) == 3 for s in optimizer.state_dict()["state"].values())
    moments = sum(float(s["exp_avg"].double().sum()) for s in optimizer.state.values())
    print(json.dumps({"fingerprint": fingerprint, "moments": moments}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
