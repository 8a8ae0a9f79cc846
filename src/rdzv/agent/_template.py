"""The agent's side of the worker template (``rdzv run --preload torch``).

The agent starts the template once (:mod:`._template_server`) so that its imports overlap the
rendezvous; each worker is then forked from it, in milliseconds, instead of starting a new
interpreter that imports torch again (seconds of CPU on every restart or replacement). A worker
started this way is seen by the rest of the agent as any other (:class:`ForkedWorker` has a
:class:`subprocess.Popen`'s ``pid``, ``stdout``, ``stderr`` and ``wait``): its pid is its process
group, its exit code is reported by the template. Should the template fail to import its
modules in time (the time a worker has for its imports, ``--worker-connect-timeout``), or die,
the agent says so once and starts its workers as new interpreters from then on.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Mapping, Sequence

from ._template_server import receive, send
from ._workers import Process, popen, signal_group

logger = logging.getLogger(__name__)

START_TIMEOUT = 30.0
"""Seconds the template has to answer a start (a fork: milliseconds)."""
CLOSE_WAIT = 10.0
"""Seconds to wait for the template to be reaped once it is killed or has closed its socket."""
_TEMPLATE_MAIN = "import sys; from rdzv.agent._template_server import main; main(sys.argv[1:])"
KILLED = -9
"""The return code of a worker whose template died (it received SIGKILL with it)."""


def python_program(command: Sequence[str]) -> tuple[list[str], list[str], bool] | None:
    """How a template runs ``command`` (``python [-u] SCRIPT ARGS`` or ``python [-u] -m MODULE
    ARGS``): the program (``["path", SCRIPT]`` or ``["module", MODULE]``), its ``sys.argv`` and
    whether it is unbuffered; None for any other command line."""
    options = []
    index = 1
    while index < len(command) and command[index] == "-u":
        options.append(command[index])
        index += 1
    rest = list(command[index:])
    if rest[:1] == ["-m"] and len(rest) > 1:
        return ["module", rest[1]], [rest[1], *rest[2:]], bool(options)
    if rest and not rest[0].startswith("-"):
        return ["path", rest[0]], rest, bool(options)
    return None


def worker_path(program: Sequence[str]) -> str:
    """The ``sys.path[0]`` of a worker running ``program`` (as :func:`python_program` gives it):
    the script's real directory, or the working directory for a module, as python sets it."""
    kind, target = program
    return os.path.dirname(os.path.realpath(target)) if kind == "path" else os.getcwd()


class ForkedWorker:
    """A worker forked by the template: what :class:`WorkerGroup` uses of a ``Popen``."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._exited = threading.Event()

    def ended(self, returncode: int) -> None:
        self.returncode = returncode
        self._exited.set()

    def wait(self) -> int:
        self._exited.wait()
        assert self.returncode is not None
        return self.returncode


class _Pending:
    """A start sent to the template, until it answers."""

    def __init__(self, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.streams = (stdout, stderr)
        self.answered = threading.Event()
        self.worker: ForkedWorker | None = None
        self.error = ""


class WorkerTemplate:
    """The template process of one agent and the workers forked from it.

    Args:
        command: the worker command line (a Python one: see :func:`python_program`).
        modules: what the template imports.
        env: the template's environment (as the workers', so that libraries reading it at
            import, such as OpenMP's thread count, see the workers' values).
        say: how the agent tells the person at the console.
        ready_timeout: seconds the first workers wait for the template's imports before they
            start without it (the time a worker has for its own imports).
    """

    def __init__(self, command: Sequence[str], modules: Sequence[str], env: Mapping[str, str],
                 say: Callable[[str], None], ready_timeout: float) -> None:
        program = python_program(command)
        if program is None:
            raise ValueError(f"not a Python worker command: {list(command)!r}")
        self.program, self.argv, self.unbuffered = program
        self.interpreter = command[0]
        self.command = list(command)
        self.modules = list(modules)
        self.env = dict(env)
        self.ready_timeout = ready_timeout
        self._say = say
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = threading.Event()
        self._failed = ""
        self._said = False
        self._ready_by = 0.0
        self._lock = threading.Lock()
        self._next_id = 0
        self._pending: dict[int, _Pending] = {}
        self._workers: dict[int, ForkedWorker] = {}

    # -- the template process -------------------------------------------------------------------
    def open(self) -> None:
        """Start the template (from a thread that outlives it: it dies with that thread)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        flags = ["-u"] if self.unbuffered else []
        with theirs:
            self._process = subprocess.Popen(
                [self.interpreter, *flags, "-c", _TEMPLATE_MAIN, str(os.getpid()),
                 str(theirs.fileno()), worker_path(self.program), *self.modules, "--",
                 *self.command],
                env=self.env, stdin=subprocess.DEVNULL, stdout=_stderr_fd(),
                pass_fds=(theirs.fileno(),), start_new_session=True)
        self._sock = ours
        self._ready_by = time.monotonic() + self.ready_timeout
        threading.Thread(target=self._listen, daemon=True, name="rdzv-template").start()
        logger.info("worker template pid %d importing %s", self._process.pid,
                    ", ".join(self.modules))

    def settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the template to be ready or to have failed; whether it
        is either."""
        return self._ready.wait(timeout)

    def usable(self) -> bool:
        """Ready, and not failed."""
        return self._ready.is_set() and not self._failed

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def close(self) -> None:
        """Stop the template (its workers die with it: stop them first)."""
        if self._process is None:
            return
        self._process.kill()
        try:
            self._process.wait(timeout=CLOSE_WAIT)
        except subprocess.TimeoutExpired:
            logger.error("worker template pid %d did not die after SIGKILL", self._process.pid)
        if self._sock is not None:
            self._sock.close()

    def _listen(self) -> None:
        assert self._sock is not None and self._process is not None
        why = ""
        try:
            while True:
                message, fds = receive(self._sock)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    break
                self._on(message)
        except OSError:  # closed by close()
            pass
        except Exception as exc:  # noqa: BLE001 (a bug: say it; the workers must not wait)
            logger.exception("the worker template's messages could not be read")
            why = f"its messages could not be read: {exc!r}"
        finally:
            if not why:
                try:
                    why = f"it ended (exit code {self._process.wait(timeout=CLOSE_WAIT)})"
                except subprocess.TimeoutExpired:
                    why = "it closed its socket"
            self._gone(why)

    def _on(self, message: dict[str, Any]) -> None:
        if "ready" in message:
            self._ready.set()
        elif "started" in message:
            with self._lock:
                pending = self._pending.pop(message["started"], None)
                if pending is not None and "pid" in message:
                    pending.worker = ForkedWorker(message["pid"], *pending.streams)
                    self._workers[message["pid"]] = pending.worker
            if pending is None:  # its start timed out and was made anew: not a second worker
                if "pid" in message:
                    signal_group(message["pid"], signal.SIGKILL)
                return
            pending.error = message.get("error", "")
            pending.answered.set()
        elif "exited" in message:
            with self._lock:
                worker = self._workers.pop(message["exited"], None)
            if worker is not None:
                worker.ended(message["returncode"])
        elif "error" in message:
            self._failed = message["error"]
            self._ready.set()

    def _gone(self, why: str) -> None:
        """The template is gone (or no longer heard: then it is killed, and its workers die
        with it): its workers are ended; starts wait no more."""
        if self._process is not None:
            self._process.kill()
        with self._lock:
            self._failed = self._failed or why
            workers, self._workers = list(self._workers.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        for worker in workers:
            worker.ended(KILLED)
        for start in pending:
            start.error = self._failed
            start.answered.set()
        self._ready.set()

    # -- starting workers -----------------------------------------------------------------------
    def start_worker(self, command: Sequence[str], env: Mapping[str, str],
                     stdout: IO[bytes] | int, stderr: IO[bytes] | int) -> Process:
        """Start one worker of ``command`` (the template's): forked from the template, or, the
        template unusable, as a new process. ``stdout``/``stderr``: a file or
        ``subprocess.PIPE``."""
        if not self._ready.wait(max(0.0, self._ready_by - time.monotonic())):
            self._failed = self._failed or (f"it did not import {', '.join(self.modules)} "
                                            f"within {self.ready_timeout:g} s")
            self.close()
        if not self._failed:
            try:
                return self._fork(env, stdout, stderr)
            except OSError as exc:
                self._failed = f"it could not start a worker: {exc}"
                self.close()  # (not used again: its memory is freed)
        if not self._said:
            self._said = True
            self._say(f"--preload: the worker template is not usable ({self._failed}); "
                      "starting workers as new processes")
        return popen(command, env, stdout, stderr)

    def _fork(self, env: Mapping[str, str], stdout: IO[bytes] | int,
              stderr: IO[bytes] | int) -> ForkedWorker:
        assert self._sock is not None
        fds: list[int] = []
        ends: list[IO[bytes] | None] = []
        ident = -1
        try:
            for stream in (stdout, stderr):
                if stream == subprocess.PIPE:
                    read, write = os.pipe()
                    ends.append(os.fdopen(read, "rb"))
                    fds.append(write)
                else:
                    ends.append(None)
                    fds.append(os.dup(stream.fileno()))  # type: ignore[union-attr]
            with self._lock:
                ident, self._next_id = self._next_id, self._next_id + 1
                pending = self._pending[ident] = _Pending(ends[0], ends[1])
            send(self._sock, {"start": ident, "program": self.program, "argv": self.argv,
                              "env": dict(env), "cwd": os.getcwd(),
                              "unbuffered": self.unbuffered}, tuple(fds))
            if not pending.answered.wait(START_TIMEOUT):
                raise OSError(f"no answer within {START_TIMEOUT:g} s")
            if pending.worker is None:
                raise OSError(pending.error)
            return pending.worker
        except OSError:
            with self._lock:
                self._pending.pop(ident, None)  # a later answer is killed (see _on)
                late = pending.worker if ident >= 0 else None
                if late is not None:  # answered as the wait ended: not a second worker either
                    self._workers.pop(late.pid, None)
            if late is not None:
                signal_group(late.pid, signal.SIGKILL)
            for end in ends:
                if end is not None:
                    end.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)


def _stderr_fd() -> int | None:
    """The agent's stderr for the template's output (None: inherited, where it has no fd)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None

