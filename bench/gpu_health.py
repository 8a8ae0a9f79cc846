"""The health checks on a GPU: what only a machine with one can show (run there by hand; CI has
none). Run: ``PYTHONPATH=src python3 bench/gpu_health.py``

1. The step's split on the GPU's stream (``rdzv.torch._steptime.GpuClock``): a model on the GPU
   whose stream waits ``WAIT_MS`` between its last gradient and its optimizer step (a kernel that
   spins, standing in for NCCL's reduction waiting for a slower rank) must show that wait, where
   the CPU's stamps see almost nothing.
2. Where a silent worker is: a training thread blocked in ``.item()`` while its stream still has
   work counts as waiting (its stream may wait on a peer's collective); one in its own code with
   an idle GPU does not.
3. A real run: two ``rdzv run`` nodes (a standalone ``rdzv serve``) training the example on the GPU
   (``--device cuda``, gloo: one GPU cannot host two NCCL ranks), one worker hung at step 60 in
   its own code: it alone is declared hung, the other goes on, the run completes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch
from torch import nn

from rdzv.torch._steptime import StepTimer

WAIT_MS = 20.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spin_cycles(ms: float) -> int:
    """Clock cycles of ``torch.cuda._sleep`` that take about ``ms`` on this GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


def split_on_the_stream() -> None:
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    timer = StepTimer(model, optimizer)
    spin_cycles(WAIT_MS)  # (warm-up: the clock rises under load)
    cycles = spin_cycles(WAIT_MS)
    inputs = torch.randn(512, 1024, device="cuda")
    cpu_waits, spins = [], []
    started = time.perf_counter()
    for _ in range(50):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        spin = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spin[0].record()
        torch.cuda._sleep(cycles)  # the stream waits, as on NCCL's reduction
        spin[1].record()
        spins.append(spin)
        optimizer.step()
        now = time.perf_counter()
        cpu_waits.append(timer._applied_at - timer._grads_at)
        timer.step(started, now)
        started = now
    torch.cuda.synchronize()
    compute, wait = timer.take()
    assert compute is not None and wait is not None
    injected = sum(a.elapsed_time(b) for a, b in spins) / len(spins)
    print(f"1. on the stream: wait {wait * 1e3:.2f} ms per step (injected {injected:.2f} ms), "
          f"work {compute * 1e3:.2f} ms; the CPU's stamps saw "
          f"{sum(cpu_waits) / len(cpu_waits) * 1e3:.3f} ms of wait")
    ok = abs(wait * 1e3 - injected) < 0.1 * injected + 0.2
    print(f"   {'OK' if ok else 'FAILED'}: the wait on the stream is the injected one")


def where_is_it() -> None:
    model = nn.Linear(16, 16).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    timer = StepTimer(model, optimizer)
    seen: list[bool] = []
    started = time.perf_counter()
    probe = threading.Timer(0.5, lambda: seen.append(timer.waiting(started)[0]))
    probe.start()
    torch.cuda._sleep(spin_cycles(1500.0))
    torch.ones(1, device="cuda").sum().item()  # blocked on a busy stream
    probe.join()
    probe = threading.Timer(0.3, lambda: seen.append(timer.waiting(started)[0]))
    probe.start()
    time.sleep(0.6)  # its own code, the GPU idle
    probe.join()
    print(f"2. blocked on a busy stream: waiting={seen[0]}; in its own code with an idle GPU: "
          f"waiting={seen[1]}")
    print(f"   {'OK' if seen == [True, False] else 'FAILED'}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hung_worker_on_the_gpu() -> None:
    work = tempfile.mkdtemp(prefix="rdzv-gpu-health-")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "PYTHONUNBUFFERED": "1"}
    rdzv = [sys.executable, "-m", "rdzv"]
    server = subprocess.Popen([*rdzv, "serve", "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    time.sleep(2.0)
    run = [*rdzv, "run", "--nnodes", "2", "--rdzv-backend", "tcp", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "gpu", "--local-addr", "127.0.0.1",
           "--hang-timeout", "3", "--max-restarts", "2", "--stop-timeout", "5",
           os.path.join(ROOT, "examples", "elastic_train.py"), "--device", "cuda", "--steps",
           "200", "--step-sleep", "0.02", "--log-every", "50",
           "--checkpoint", os.path.join(work, "ckpt")]
    logs = [open(os.path.join(work, f"node{i}.log"), "w+") for i in range(2)]
    nodes = [subprocess.Popen(run, stdout=logs[0], stderr=subprocess.STDOUT, env=env),
             subprocess.Popen(run, stdout=logs[1], stderr=subprocess.STDOUT,
                              env={**env, "RDZV_EXAMPLE_HANG_AT": "60"})]
    try:
        codes = [node.wait(240) for node in nodes]
    finally:
        for process in (*nodes, server):
            process.kill()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
    healthy, hung = outputs
    ok = (codes == [0, 0] and "is hung" in hung and "is hung" not in healthy
          and "waits in a collective" in healthy and "done: 200 steps" in healthy + hung)
    print(f"3. two nodes on the GPU, one worker hung at step 60: exit codes {codes}; the hung "
          f"node: {[line for line in hung.splitlines() if 'is hung' in line][:1]}; the other: "
          f"{[line for line in healthy.splitlines() if 'waits in a collective' in line][:1]}")
    print(f"   {'OK' if ok else 'FAILED'}")
    if not ok:
        print("--- healthy node ---\n" + healthy[-4000:] + "\n--- hung node ---\n" + hung[-6000:])


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    split_on_the_stream()
    where_is_it()
    hung_worker_on_the_gpu()


if __name__ == "__main__":
    main()
