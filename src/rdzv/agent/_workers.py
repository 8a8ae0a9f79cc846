"""The worker processes of one node: start them with their env and logs, watch them, stop them.

Each worker runs in its own session (process group), so stopping it also stops the processes
it started; on Linux it is also killed if the agent dies (``PR_SET_PDEATHSIG``). A thread per
worker blocks in ``waitpid`` and reports the exit as a :class:`WorkerExited` event on the
agent's queue: nothing polls. Each stream goes to ``<attempt dir>/<local rank>/stdout.log`` /
``stderr.log``; a stream shown on the console is piped through a thread that writes each line to
the file and, prefixed with ``[<global rank>]:``, to the agent's own stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import IO, Any, Callable, Mapping, Protocol, Sequence, TextIO

logger = logging.getLogger(__name__)

KILL_WAIT = 10.0
"""Seconds to wait for a SIGKILLed process group to be reaped."""
LOG_DRAIN_TIMEOUT = 5.0
"""Seconds to wait for a pipe's last lines after its worker exited (a grandchild may hold it)."""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its ranks and complete environment."""

    local_rank: int
    global_rank: int
    env: Mapping[str, str]


@dataclass(frozen=True)
class WorkerExited:
    """Event: worker ``local_rank`` of group ``generation`` ended with ``returncode``."""

    generation: int
    local_rank: int
    returncode: int
    time: float


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (Linux), loaded once: a forked child must not ``dlopen``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


PRCTL = _load_prctl()
PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """In a child of ``parent``: receive SIGKILL when ``parent`` dies (Linux); exit at once if
    it already has. A worker's start (a new process's, or one forked by the template), and the
    template's own."""
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(1)


class Process(Protocol):
    """A started worker process, as :class:`WorkerGroup` uses it (a ``subprocess.Popen`` or a
    worker forked by the template)."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def wait(self) -> int: ...


Starter = Callable[[Sequence[str], Mapping[str, str], "IO[bytes] | int", "IO[bytes] | int"],
                   Process]
"""Starts one worker: (command, env, stdout, stderr: a file or ``subprocess.PIPE``)."""


def popen(command: Sequence[str], env: Mapping[str, str], stdout: IO[bytes] | int,
          stderr: IO[bytes] | int) -> subprocess.Popen[bytes]:
    """Start a worker as a new process, in a session of its own, dying with the agent."""
    return subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        start_new_session=True,
        preexec_fn=functools.partial(die_with, os.getpid()),  # noqa: PLW1509 (only prctl)
    )


class _Worker:
    """A started worker: its process, log files and the thread waiting for its exit."""

    def __init__(self, spec: WorkerSpec, process: Process, directory: str,
                 pumps: list[threading.Thread]) -> None:
        self.spec = spec
        self.process = process
        self.directory = directory
        self.pumps = pumps
        self.exited = threading.Event()
        self.returncode: int | None = None
        self.end_time: float | None = None

    @property
    def log_files(self) -> tuple[str, ...]:
        return (os.path.join(self.directory, "stdout.log"),
                os.path.join(self.directory, "stderr.log"))

    @property
    def error_file(self) -> str:
        return os.path.join(self.directory, "error.json")


class WorkerGroup:
    """The workers of one node for one round: started together, watched, stopped together.

    Args:
        command: the worker command line.
        attempt_dir: directory of this attempt's logs (one sub-directory per local rank).
        events: where :class:`WorkerExited` events are put (a ``queue.SimpleQueue``, which may
            also be fed by signal handlers).
        generation: tags this group's events, so the agent can ignore a previous group's.
        console_streams: the streams of a local rank shown on the console.
        starter: how a worker's process starts (a new process, or forked by the template).
    """

    def __init__(
        self,
        command: Sequence[str],
        attempt_dir: str,
        events: "queue.SimpleQueue[Any]",
        generation: int,
        console_streams: Callable[[int], frozenset[str]],
        starter: Starter = popen,
    ) -> None:
        self.command = list(command)
        self.attempt_dir = attempt_dir
        self.generation = generation
        self._events = events
        self._console_streams = console_streams
        self._workers: dict[int, _Worker] = {}
        self._console_lock = threading.Lock()
        self._starter = starter

    # -- starting -----------------------------------------------------------------------------
    def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Start one process per spec (from the calling thread, which must outlive them)."""
        for spec in specs:
            directory = os.path.join(self.attempt_dir, str(spec.local_rank))
            os.makedirs(directory, exist_ok=True)
            env = dict(spec.env)
            env["TORCHELASTIC_ERROR_FILE"] = error_file = os.path.join(directory, "error.json")
            with contextlib.suppress(FileNotFoundError):  # a predecessor's, read when it failed
                os.remove(error_file)
            shown = self._console_streams(spec.local_rank)
            # appended to: a worker started again in its slot (it replaces one that crashed)
            # keeps its predecessor's lines before its own
            files = {name: open(os.path.join(directory, f"{name}.log"), "ab")
                     for name in ("stdout", "stderr")}
            try:
                process = self._starter(
                    self.command, env,
                    subprocess.PIPE if "stdout" in shown else files["stdout"],
                    subprocess.PIPE if "stderr" in shown else files["stderr"])
            except OSError as exc:
                for handle in files.values():
                    handle.close()
                self.stop(timeout=0)
                raise RuntimeError(f"cannot start worker {spec.local_rank} with "
                                   f"{self.command!r}: {exc}") from exc
            pumps = []
            for name, pipe, target in (("stdout", process.stdout, sys.stdout),
                                       ("stderr", process.stderr, sys.stderr)):
                if pipe is None:
                    files[name].close()  # the child holds its own copy
                    continue
                pumps.append(self._pump(pipe, files[name], target, spec))
            worker = _Worker(spec, process, directory, pumps)
            self._workers[spec.local_rank] = worker
            threading.Thread(target=self._wait_for, args=(worker,), daemon=True,
                             name=f"rdzv-worker-{spec.local_rank}").start()

    def _pump(self, pipe: IO[bytes], log: IO[bytes], console: TextIO,
              spec: WorkerSpec) -> threading.Thread:
        def copy() -> None:
            with pipe, log:
                for line in iter(pipe.readline, b""):
                    log.write(line)
                    log.flush()
                    current = self._workers.get(spec.local_rank)  # renumbered by a switch
                    rank = (current.spec if current else spec).global_rank
                    prefix = (f"[{rank}]:" if rank >= 0 else
                              f"[joining {spec.local_rank}]:").encode()
                    with self._console_lock:
                        try:
                            console.flush()
                            console.buffer.write(prefix + line + (b"" if line.endswith(b"\n")
                                                                  else b"\n"))
                            console.buffer.flush()
                        except (OSError, ValueError, AttributeError):
                            pass  # the console went away; the log file still has the line

        thread = threading.Thread(target=copy, daemon=True, name=f"rdzv-log-{spec.local_rank}")
        thread.start()
        return thread

    def _wait_for(self, worker: _Worker) -> None:
        returncode = worker.process.wait()
        worker.end_time = time.time()
        worker.returncode = returncode
        worker.exited.set()
        self._events.put(WorkerExited(self.generation, worker.spec.local_rank, returncode,
                                      worker.end_time))

    def renumber(self, ranks: Mapping[int, int]) -> None:
        """The workers run on in-process in a new group: their global ranks (by local rank)."""
        for local_rank, rank in ranks.items():
            worker = self._workers.get(local_rank)
            if worker is not None:
                worker.spec = replace(worker.spec, global_rank=rank)

    # -- state ----------------------------------------------------------------------------------
    @property
    def specs(self) -> list[WorkerSpec]:
        return [w.spec for w in self._workers.values()]

    def pids(self) -> dict[int, int]:
        """local rank -> pid of every worker started."""
        return {rank: w.process.pid for rank, w in self._workers.items()}

    def returncodes(self) -> dict[int, int | None]:
        """local rank -> return code (None while running)."""
        return {rank: w.returncode for rank, w in self._workers.items()}

    def all_exited(self) -> bool:
        return all(w.exited.is_set() for w in self._workers.values())

    def wait_exited(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every worker to exit by itself; whether all did."""
        deadline = time.monotonic() + timeout
        for worker in self._workers.values():
            worker.exited.wait(max(0.0, deadline - time.monotonic()))
        return self.all_exited()

    def worker_files(self, local_rank: int) -> tuple[tuple[str, ...], str]:
        """(log files, error file) of a worker."""
        worker = self._workers[local_rank]
        return worker.log_files, worker.error_file

    def end_time(self, local_rank: int) -> float | None:
        return self._workers[local_rank].end_time

    # -- stopping -------------------------------------------------------------------------------
    def send_signal(self, local_rank: int, signum: int, group: bool = True) -> bool:
        """Send ``signum`` to one running worker (its process group, or only its process);
        whether it was running."""
        worker = self._workers.get(local_rank)
        if worker is None or worker.exited.is_set():
            return False
        if group:
            signal_group(worker.process.pid, signum)
        else:
            try:
                os.kill(worker.process.pid, signum)
            except ProcessLookupError:
                return False
        return True

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to the process group of every worker still running."""
        for worker in self._workers.values():
            if not worker.exited.is_set():
                signal_group(worker.process.pid, signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Send ``signum`` to every running worker, wait up to ``timeout`` s, then SIGKILL.

        Returns once every worker has been reaped and its log pipes drained (bounded waits).
        """
        running = [w for w in self._workers.values() if not w.exited.is_set()]
        if running:
            logger.info("stopping %d worker(s) with %s (grace %.3g s)", len(running),
                        signal.Signals(signum).name, timeout)
            self.signal_all(signum)
            deadline = time.monotonic() + timeout
            for worker in running:
                worker.exited.wait(max(0.0, deadline - time.monotonic()))
            late = [w for w in running if not w.exited.is_set()]
            if late:
                logger.warning("%d worker(s) still running after %.3g s: SIGKILL", len(late),
                               timeout)
                for worker in late:
                    signal_group(worker.process.pid, signal.SIGKILL)
                for worker in late:
                    if not worker.exited.wait(KILL_WAIT):
                        logger.error("worker pid %d did not die after SIGKILL",
                                     worker.process.pid)
        for worker in self._workers.values():
            # a worker that exited leaves its children behind: stop them too
            signal_group(worker.process.pid, signal.SIGKILL)
        self.drain_logs()

    def drain_logs(self) -> None:
        """Wait (bounded) for the log pumps of exited workers to write their last lines."""
        deadline = time.monotonic() + LOG_DRAIN_TIMEOUT
        for worker in self._workers.values():
            if worker.exited.is_set():
                for pump in worker.pumps:
                    pump.join(max(0.0, deadline - time.monotonic()))


def signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group ``pid`` (a worker's session), if it is still there."""
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
