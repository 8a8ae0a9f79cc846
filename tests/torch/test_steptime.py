"""How a worker's step splits into its own work and the wait for the others
(``rdzv/torch/_steptime.py``), on a real model and optimizer: the wait is the time between the
last gradient and the optimizer's step (where the gradients' reduction waits), and a thread can
tell where the training thread is while it makes no progress."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

from rdzv.torch._group import ABORT_GRACE
from rdzv.torch._steptime import STEP_OUTLIER, StepTimer, mean_step

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


@pytest.mark.parametrize(("mean", "elapsed", "expected"), [
    (None, 0.05, 0.05),                     # the first step is the mean
    (0.05, 0.05, 0.05),
    (0.05, 0.10, 0.06),                     # a moving average
    (0.05, 6.00, 0.05 * (0.8 + 0.2 * STEP_OUTLIER)),  # a step spanning a 6 s SIGSTOP: capped
])
def test_the_mean_step_time(mean: float | None, elapsed: float, expected: float) -> None:
    assert mean_step(mean, elapsed) == pytest.approx(expected)


def test_a_step_spanning_a_stop_does_not_lengthen_the_next_aborts_grace() -> None:
    """Seen in the training chaos soak: steps of 0.06 s, then one of 5.9 s (the node was
    SIGSTOPped): the mean rose to 1.2 s, and the abort that followed waited 3 means, 3.7 s,
    before it ended a worker stuck in gloo. Capped, the grace is the floor again."""
    mean: float | None = None
    for _ in range(20):
        mean = mean_step(mean, 0.06)
    mean = mean_step(mean, 5.9)
    assert mean is not None and max(ABORT_GRACE, 3 * mean) == ABORT_GRACE
    for _ in range(10):  # a real slow-down (10x) shows within a few steps all the same
        mean = mean_step(mean, 0.6)
    assert mean > 0.3


def blocked_or_computing(blocked: bool) -> tuple[bool, bool]:
    """A training thread past its backward pass, then blocked (as in a reduction that does not
    wake) or computing; what ``StepTimer.stuck`` says of it for an abort after its last
    gradient, and for one before it."""
    box: dict[str, Any] = {}
    ready, done = threading.Event(), threading.Event()

    def train() -> None:
        model = nn.Linear(16, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        box["timer"], box["started"] = StepTimer(model, optimizer), time.perf_counter()
        optimizer.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        ready.set()
        if blocked:
            done.wait(30)
        else:
            deadline, total = time.monotonic() + 30, 0
            while not done.is_set() and time.monotonic() < deadline:
                total += 1  # its own work
        optimizer.step()

    thread = threading.Thread(target=train)
    thread.start()
    try:
        assert ready.wait(30)
        timer, started = box["timer"], box["started"]
        return timer.stuck(started, time.perf_counter()), timer.stuck(started, started - 1.0)
    finally:
        done.set()
        thread.join(30)


def test_a_thread_blocked_in_the_reduction_since_an_abort_is_stuck() -> None:
    assert blocked_or_computing(blocked=True) == (True, False)


def test_a_thread_that_computes_after_its_gradients_is_not_stuck() -> None:
    assert blocked_or_computing(blocked=False) == (False, False)
