"""How a worker's steps split into its own work and waiting for the other ranks, and where its
training thread is when it makes no progress.

A synchronous step ends with the gradients' reduction: a rank that finished its backward pass
waits there for the slowest one. :class:`StepTimer` stamps two moments of each step, at a cost of
a clock read each: the last gradient accumulated (a hook on each trained parameter) and the
optimizer's step starting (a pre-hook). Between the two the rank computes nothing of its own:
it waits for the reduction (DDP's last buckets, an explicit ``all_reduce`` of the gradients or
of a logged loss). The rest of the step is its own work, its *compute* time: forward, backward,
the optimizer, data loading, logging. The rank the others wait for is the one whose compute time
is longest, which is what the agents compare (``rdzv.agent._stragglers``).

On a GPU the CPU's stamps would not see the reduction (NCCL holds the stream, not the CPU), so
the same moments are taken on the stream with CUDA events (:class:`GpuClock`), read once they
have completed. What it cannot see: the part of DDP's reduction that overlaps the backward pass
(it costs the step nothing), and collectives in the forward pass (FSDP's all-gathers,
SyncBatchNorm: counted as compute).
"""

from __future__ import annotations

import collections
import sys
import sysconfig
import threading
import time
from types import FrameType
from typing import Any

import torch

LIBRARIES = ("torch", "rdzv")
"""Packages whose frames are not the program's own code."""
_STDLIB = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])


STEP_OUTLIER = 4.0
"""The most one step counts for in the mean step time, in means (see :func:`mean_step`)."""


def mean_step(mean: float | None, elapsed: float) -> float:
    """The recent mean step time after a step of ``elapsed`` seconds (a moving average). A
    step longer than ``STEP_OUTLIER`` means counts as that many: one that spans a pause of the
    whole process (SIGSTOP, a suspended machine) is no step time. (In the training chaos soak
    such a step raised the mean to 1.2 s, and with it an abort's grace, three steps, to 3.7 s:
    docs/train-chaos.md.) A real slow-down still shows within a few steps."""
    if mean is None:
        return elapsed
    return 0.8 * mean + 0.2 * min(elapsed, STEP_OUTLIER * mean)


IDLE_PROBE = 0.05
"""Seconds over which a thread whose CPU time stands still counts as blocked (see :func:`stuck`)."""


def stuck(thread: int, waiting_since: bool, frame: FrameType | None) -> bool:
    """Whether ``thread`` is blocked waiting for its peers: in a collective call
    (:func:`in_collective`), or ``waiting_since`` (in the gradients' reduction with no gradient
    since an abort), and its CPU time stands still over ``IDLE_PROBE`` (a thread that computes,
    say a long backward pass between two gradients, is not blocked)."""
    if not (waiting_since or in_collective(frame)):
        return False
    try:
        clock = time.pthread_getcpuclockid(thread)
        used = time.clock_gettime(clock)
        time.sleep(IDLE_PROBE)
        return time.clock_gettime(clock) - used < IDLE_PROBE / 10
    except (OSError, AttributeError):  # the thread is gone; no per-thread clock here
        return False


class StepTimer:
    """Stamps each step's gradients and optimizer step; sums compute and wait per report."""

    def __init__(self, model: torch.nn.Module | None,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self.thread = threading.get_ident()
        """The training thread (the one that created the state)."""
        self._grads_at = 0.0
        self._applied_at = 0.0
        self._compute = self._wait = 0.0
        self._steps = 0
        self.split = model is not None and optimizer is not None
        """Whether a step splits into compute and wait (else it is all compute)."""
        device = next((p.device for p in model.parameters() if p.is_cuda), None) \
            if model is not None else None
        self._gpu = GpuClock(device) if device is not None and self.split else None
        """A model on a GPU: its stream's own times (the CPU's do not see the reduction)."""
        if self.split:
            assert model is not None and optimizer is not None
            for param in model.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._on_grad)
            optimizer.register_step_pre_hook(self._on_apply)

    def _on_grad(self, _param: torch.Tensor) -> None:
        self._grads_at = time.perf_counter()
        if self._gpu is not None:
            self._gpu.grads.record()

    def _on_apply(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._applied_at = time.perf_counter()
        if self._gpu is not None:
            self._gpu.applied.record()

    def step(self, started: float | None, now: float) -> None:
        """A step that began at ``started`` (None: after a pause that is no step) ended now."""
        if self._gpu is not None:
            self._gpu.step(counted=started is not None)
            return
        if started is None:
            return
        grads, applied = self._grads_at, self._applied_at
        wait = applied - grads if started <= grads <= applied else 0.0
        self._wait += wait
        self._compute += (now - started) - wait
        self._steps += 1

    def take(self) -> tuple[float | None, float | None]:
        """The mean compute and wait per step since the last call (None: no step)."""
        if self._gpu is not None:
            for compute, wait in self._gpu.done():
                self._compute += compute
                self._wait += wait
                self._steps += 1
        if not self._steps:
            return None, None
        compute, wait = self._compute / self._steps, self._wait / self._steps
        self._compute = self._wait = 0.0
        self._steps = 0
        return compute, (wait if self.split else None)

    def stuck(self, started: float, since: float) -> bool:
        """Whether the training thread, in a step begun at ``started``, has been blocked waiting
        for its peers since ``since`` (``perf_counter``: its group's abort): :func:`stuck`, with
        the reduction counted only if the step's last gradient came before ``since``. A busy
        GPU stream counts for nothing here (the CPU runs ahead of it all the time)."""
        reducing = started <= self._grads_at < since and self._applied_at < self._grads_at
        return stuck(self.thread, reducing, sys._current_frames().get(self.thread))

    def waiting(self, started: float) -> tuple[bool, str]:
        """Whether the training thread, in a step begun at ``started``, waits for its peers now,
        and its innermost frame of interest (called from another thread, while the training
        thread makes no progress). On a GPU a thread waiting for its stream (``.item()``, a
        synchronize) while the stream has work left waits for its peers too, as far as it can
        tell: the stream may wait on a collective."""
        frame = sys._current_frames().get(self.thread)
        in_reduction = started <= self._grads_at and self._applied_at < self._grads_at
        gpu_busy = self._gpu is not None and self._gpu.busy()
        return in_reduction or gpu_busy or in_collective(frame), describe(frame)


class GpuClock:
    """A step's moments on the GPU's stream: CUDA events recorded where the CPU stamps (the last
    gradient, the optimizer's step, the step's end), read once complete, a step or so later,
    never waited for. There the gradients' reduction shows: the stream waits on NCCL's between
    the last gradient and the optimizer's kernels."""

    KEEP = 64
    """Steps whose events wait to complete, at most (older ones are dropped unread)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = self._event()
        self.grads = self._event(record=False)
        self.applied = self._event(record=False)
        self._pending: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=self.KEEP)

    @staticmethod
    def _event(record: bool = True) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        if record:
            event.record()
        return event

    def step(self, counted: bool) -> None:
        """The step ended (``counted``: it was a step, not a pause)."""
        end = self._event()
        if counted:
            self._pending.append((self._start, self.grads, self.applied, end))
        self._start = end
        self.grads, self.applied = self._event(record=False), self._event(record=False)

    def done(self) -> list[tuple[float, float]]:
        """(compute, wait) in seconds of each step whose events have completed since."""
        out = []
        while self._pending and self._pending[0][3].query():
            start, grads, applied, end = self._pending.popleft()
            total = start.elapsed_time(end) / 1000
            try:
                wait = max(0.0, grads.elapsed_time(applied) / 1000)
            except RuntimeError:  # an event not recorded in that step (no backward, no step)
                wait = 0.0
            out.append((max(0.0, total - wait), wait))
        return out

    def busy(self) -> bool:
        """Whether the device's stream still has work to do (or waits on another stream)."""
        return not torch.cuda.default_stream(self.device).query()


def in_collective(frame: FrameType | None) -> bool:
    """Whether the stack's innermost frames, up to the program's own code, reach
    ``torch.distributed`` (a collective, a barrier, a ``wait``; not its elastic launcher's
    wrappers, which run the whole program)."""
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.startswith("torch.distributed") and \
                not module.startswith("torch.distributed.elastic"):
            return True
        if module.split(".", 1)[0] not in LIBRARIES and not _in_stdlib(frame.f_code.co_filename):
            return False  # the program's own code: whatever it waits on, it is there
        frame = frame.f_back
    return False


def describe(frame: FrameType | None) -> str:
    """``file:line in function`` of the innermost frame outside Python's own library (where a
    program waits on an event or a lock, its own line is the news)."""
    first = frame
    while frame is not None and _in_stdlib(frame.f_code.co_filename):
        frame = frame.f_back
    frame = frame or first
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _in_stdlib(path: str) -> bool:
    return path.startswith(_STDLIB) and "-packages" not in path
