"""The worker template (``rdzv run --preload``): a process that imports the workers' heavy modules
once, then forks every worker of its node from itself.

A Python worker started afresh spends seconds importing torch before its first step; a process
forked from one that has already imported it starts in milliseconds. The agent starts this module
with ``FD MODULE...`` as the arguments of :func:`main`, ``FD`` its end of a ``SOCK_SEQPACKET``
pair. Messages are JSON objects, one per packet (never pickled):

- template -> agent, once: ``{"ready": [modules]}`` or ``{"error": "..."}`` (then it exits);
- agent -> template: ``{"start": id, "program": [...], "argv": [...], "env": {...}, "cwd": ...,
  "unbuffered": bool}`` with the worker's stdout and stderr as two passed descriptors;
- template -> agent: ``{"started": id, "pid": pid}`` or ``{"started": id, "error": "..."}``,
  and ``{"exited": pid, "returncode": code}`` for every worker that ends (negative: the signal).

Each worker is the template's child, in a session of its own (its pid is its process group), and
receives SIGKILL when the template dies (``PR_SET_PDEATHSIG``), as the template does when its
agent dies. In the child, :func:`serve` returns the program to run instead of looping, so the
program runs at the top of the stack and ends as a Python program does (``atexit``, threads,
flushed streams, the exit code of ``SystemExit`` or 1 after an uncaught exception's traceback).
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from typing import Any

MAX_MESSAGE = 1 << 20
"""The largest message either side reads (a worker's environment included)."""
PR_SET_PDEATHSIG = 1


def send(sock: socket.socket, message: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    """Send one message (and descriptors) on the template's socket."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors passed with it; (None, []) once the peer is gone."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 4)
    if not data:
        return None, fds
    return json.loads(data), fds


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux); exit at once if it already has."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent or parent == 1:
        os._exit(1)


def _preload(modules: list[str]) -> str | None:
    """Import ``modules``; what went wrong, if anything."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 (a module may raise anything on import)
            return f"cannot import {name!r}: {type(exc).__name__}: {exc}"
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return ("CUDA was initialized while importing the preloaded modules; workers forked "
                "from the template could not use it: preload only modules that do not touch "
                "the GPU at import")
    return None


class Program:
    """What a forked child runs: the worker's program, its argv, streams and environment."""

    def __init__(self, request: dict[str, Any], fds: list[int]) -> None:
        self.kind, self.target = request["program"]
        self.argv: list[str] = request["argv"]
        self.env: dict[str, str] = request["env"]
        self.cwd: str = request["cwd"]
        self.unbuffered = bool(request.get("unbuffered")) or bool(
            self.env.get("PYTHONUNBUFFERED"))
        self.fds = fds

    def become(self) -> None:
        """In the forked child: take the worker's session, streams, directory and environment."""
        os.setsid()
        stdout, stderr = self.fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        encoding = getattr(sys.__stdout__, "encoding", None) or "utf-8"
        sys.stdin = open(0, encoding=encoding, closefd=False)  # noqa: SIM115
        sys.stdout = _text_stream(1, encoding, self.unbuffered, line_buffering=os.isatty(1))
        sys.stderr = _text_stream(2, encoding, self.unbuffered, line_buffering=True,
                                 errors="backslashreplace")
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.env)
        sys.argv[:] = self.argv
        sys.path[0] = (os.path.dirname(os.path.abspath(self.target)) if self.kind == "path"
                       else os.getcwd())
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:  # a fresh process seeds it from the OS: so do forks
            numpy_random.seed()

    def run(self) -> None:
        """Run the program as ``python [-m] TARGET`` would (``SystemExit`` passes through)."""
        if self.kind == "module":
            runpy.run_module(self.target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(self.target, run_name="__main__")


def _text_stream(fd: int, encoding: str, unbuffered: bool, line_buffering: bool,
                 errors: str = "strict") -> io.TextIOWrapper:
    """A standard stream on ``fd`` as the interpreter makes it (``-u``: written through)."""
    raw = io.FileIO(fd, "w", closefd=False)
    binary: io.RawIOBase | io.BufferedWriter = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=encoding, errors=errors,  # type: ignore[arg-type]
                            write_through=unbuffered, line_buffering=line_buffering and not unbuffered)


def _returncode(status: int) -> int:
    """A wait status as :class:`subprocess.Popen` gives it (negative: killed by that signal)."""
    return os.waitstatus_to_exitcode(status)


def serve(sock: socket.socket) -> Program | None:
    """Start workers as the agent asks and report their exits; returns None when the agent is
    gone, and, in each forked child, the program that child is to run."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    try:
        while True:
            ready, _w, _x = select.select([sock.fileno(), wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 512)
                _reap(sock, children)
            if sock.fileno() not in ready:
                continue
            request, fds = receive(sock)
            if request is None:
                return None
            program = Program(request, fds)
            try:
                pid = os.fork()
            except OSError as exc:
                send(sock, {"started": request["start"], "error": f"fork failed: {exc}"})
                for fd in fds:
                    os.close(fd)
                continue
            if pid == 0:
                children.clear()  # the template's to watch, not this worker's
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                sock.close()
                _die_with_parent()
                program.become()
                return program
            children.add(pid)
            for fd in fds:
                os.close(fd)
            send(sock, {"started": request["start"], "pid": pid})
    finally:
        if children:  # the agent is gone (or the loop failed): so are the workers
            for pid in children:
                _kill_group(pid)


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Report every child that ended."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        send(sock, {"exited": pid, "returncode": _returncode(status)})


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError as exc:
        if exc.errno not in (errno.ESRCH, errno.EPERM):
            raise


def main(argv: list[str]) -> None:
    """The template process (``argv``: its socket's descriptor, the modules): preload the
    modules, say so, then serve until the agent is gone; in a forked child, run the worker's
    program."""
    _die_with_parent()
    sock = socket.socket(fileno=int(argv[0]))
    modules = argv[1:]
    failure = _preload(modules)
    if failure is not None:
        send(sock, {"error": failure})
        return
    send(sock, {"ready": modules})
    try:
        program = serve(sock)
    except BrokenPipeError:  # the agent is gone
        return
    except BaseException:  # noqa: BLE001 (anything else is a bug: say it on the agent's stderr)
        traceback.print_exc()
        raise
    if program is not None:
        program.run()

