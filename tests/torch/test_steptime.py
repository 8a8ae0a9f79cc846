"""How a worker's step splits into its own work and the wait for the others
(``rdzv/torch/_steptime.py``), on a real model and optimizer: the wait is the time between the
last gradient and the optimizer's step (where the gradients' reduction waits), and a thread can
tell where the training thread is while it makes no progress."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from rdzv.torch._steptime import StepTimer

WAIT = 0.6
WORK = 0.2
"""(Apart by more than a loaded machine's oversleep and slow steps, 0.1 s seen in CI: a wait
taken for work, or work for a wait, lands outside the other's bounds.)"""


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, wait: float = 0.0,
               work: float = 0.0) -> None:
    time.sleep(work)  # the rank's own work (data loading, say)
    optimizer.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    time.sleep(wait)  # where DDP's reduction waits for the slowest rank
    optimizer.step()


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_a_step_splits_into_work_and_wait() -> None:
    model, optimizer = make()
    timer = StepTimer(model, optimizer)
    train_step(model, optimizer)  # autograd's first backward starts its threads: not timed
    started = time.perf_counter()
    for _ in range(4):
        train_step(model, optimizer, wait=WAIT, work=WORK)
        now = time.perf_counter()
        timer.step(started, now)
        started = now
    compute, wait = timer.take()
    assert compute is not None and wait is not None
    assert WAIT <= wait < WAIT + WORK, wait
    assert WORK <= compute < WAIT, compute
    assert timer.take() == (None, None)  # taken: the next report starts anew


def test_without_an_optimizer_a_step_is_all_work() -> None:
    model, optimizer = make()
    timer = StepTimer(model, None)
    started = time.perf_counter()
    train_step(model, optimizer, wait=WAIT)
    timer.step(started, time.perf_counter())
    compute, wait = timer.take()
    assert wait is None and compute is not None and compute >= WAIT


def test_a_pause_that_is_no_step_is_not_counted() -> None:
    model, optimizer = make()
    timer = StepTimer(model, optimizer)
    timer.step(None, time.perf_counter())
    assert timer.take() == (None, None)


@pytest.mark.parametrize("wait, work, waiting", [(0.5, 0.0, True), (0.0, 0.5, False)])
def test_where_the_training_thread_is(wait: float, work: float, waiting: bool) -> None:
    model, optimizer = make()
    timer = StepTimer(model, optimizer)
    seen: list[tuple[bool, str]] = []
    started = time.perf_counter()
    probe = threading.Timer(0.25, lambda: seen.append(timer.waiting(started)))
    probe.start()
    train_step(model, optimizer, wait=wait, work=work)
    probe.join()
    assert seen and seen[0][0] is waiting, seen
    assert "test_steptime.py" in seen[0][1] and "in train_step" in seen[0][1], seen
