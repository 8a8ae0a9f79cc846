"""The worker template (``rdzv run --preload``): a process that imports the workers' heavy modules
once, then forks every worker of its node from itself.

A Python worker started afresh spends seconds importing torch before its first step; a process
forked from one that has already imported it starts in milliseconds. The agent starts the
template with ``AGENT FD PATH0 MODULE... -- COMMAND...`` as the arguments of :func:`main`: the
agent's pid, ``FD`` its end of a ``SOCK_SEQPACKET`` pair, ``PATH0`` the workers' ``sys.path[0]``
(the script's directory), the modules, and the worker command, which only shows in ``ps``: a
forked worker has its template's command line, so ``pgrep -f train.py`` finds it. Messages are
JSON objects, one per packet (never pickled):

- template -> agent, once: ``{"ready": [modules]}`` or ``{"error": "..."}`` (then it exits);
- agent -> template: ``{"start": id, "program": [kind, target], "argv": [...], "env": {...},
  "cwd": ..., "unbuffered": bool}`` with the worker's stdout and stderr as two passed descriptors;
- template -> agent: ``{"started": id, "pid": pid}`` (once the worker leads its own session) or
  ``{"started": id, "error": "..."}``, and ``{"exited": pid, "returncode": code}`` for every
  worker that ends (negative: the signal that ended it).

Each worker is the template's child, in a session of its own (its pid is its process group), and
receives SIGKILL when the template dies (``PR_SET_PDEATHSIG``), as the template does when its
agent dies. In the child, :func:`serve` returns the program to run instead of looping, so the
program runs at the top of the stack, in a ``__main__`` module of its own that stays installed,
and ends as a Python program does (``atexit``, threads, flushed streams, the exit code of
``SystemExit`` or 1 after an uncaught exception's traceback).
"""

from __future__ import annotations

import builtins
import ctypes
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import select
import signal
import socket
import sys
import traceback
import types
from typing import Any

from ._workers import PRCTL, die_with, signal_group

MAX_MESSAGE = 1 << 20
"""The largest message either side reads (a worker's environment included)."""
PR_SET_NAME = 15
TEMPLATE_NAME = "rdzv-template"
"""The template's process name; its workers take back the interpreter's (``python3``...)."""


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


def _name(name: str) -> str:
    """Set this process's name (``ps -o comm``, ``top``; Linux); the name it had."""
    try:
        with open("/proc/self/comm") as handle:
            before = handle.read().strip()
    except OSError:
        return name
    if PRCTL is not None:
        PRCTL(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))
    return before


def _preload(modules: list[str]) -> str | None:
    """Import ``modules``; what went wrong, if anything."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 (a module may raise anything on import)
            return f"cannot import {name!r}: {type(exc).__name__}: {exc}"
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return ("CUDA was initialized while importing the preloaded modules, and workers "
                "forked after that cannot use it: preload only modules that do not touch the "
                "GPU at import")
    return None


class Program:
    """What a forked child runs: the worker's program, its argv, streams and environment."""

    def __init__(self, request: dict[str, Any], fds: list[int]) -> None:
        self.kind, self.target = request["program"]
        self.argv: list[str] = request["argv"]
        self.env: dict[str, str] = request["env"]
        self.cwd: str = request["cwd"]
        self.unbuffered = bool(request["unbuffered"])
        self.fds = fds

    def become(self, template: int) -> None:
        """In the child forked by ``template``: take the worker's streams, directory and
        environment (its session is already its own)."""
        die_with(template)
        stdout, stderr = self.fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        unbuffered = self.unbuffered or bool(self.env.get("PYTHONUNBUFFERED"))
        encoding = getattr(sys.__stdout__, "encoding", None) or "utf-8"
        sys.stdin = open(0, encoding=encoding, closefd=False)  # noqa: SIM115
        sys.stdout = _text_stream(1, encoding, unbuffered, line_buffering=os.isatty(1))
        sys.stderr = _text_stream(2, encoding, unbuffered, line_buffering=True,
                                  errors="backslashreplace")
        os.chdir(self.cwd)
        os.environ.clear()
        os.environ.update(self.env)
        sys.argv[:] = self.argv
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:  # a fresh process seeds it from the OS: so do forks
            numpy_random.seed()

    def run(self) -> None:
        """Run the program as ``python -u [-m] TARGET`` does: its code in a new ``__main__``
        module that stays in ``sys.modules`` (``SystemExit`` passes through)."""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        if self.kind == "module":
            spec = importlib.util.find_spec(self.target)
            if spec is not None and spec.submodule_search_locations is not None:
                spec = importlib.util.find_spec(f"{self.target}.__main__")  # a package
            if spec is None or spec.loader is None or spec.origin is None:
                raise SystemExit(f"{sys.executable}: No module named {self.target}")
            code = spec.loader.get_code(spec.name)  # type: ignore[attr-defined]
            main.__spec__, main.__loader__, main.__package__ = spec, spec.loader, spec.parent
            sys.argv[0] = main.__file__ = spec.origin
        else:
            path = os.path.abspath(self.target)  # (python makes the script's __file__ absolute)
            with open(path, "rb") as handle:  # (not this module's __future__ flags)
                code = compile(handle.read(), path, "exec", dont_inherit=True)
            main.__file__ = path
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        main.__cached__ = None  # type: ignore[attr-defined]
        sys.modules["__main__"] = main
        exec(code, main.__dict__)  # noqa: S102 (the worker's own program, as python runs it)


def _text_stream(fd: int, encoding: str, unbuffered: bool, line_buffering: bool,
                 errors: str = "strict") -> io.TextIOWrapper:
    """A standard stream on ``fd`` as the interpreter makes it (``-u``: written through)."""
    raw = io.FileIO(fd, "w", closefd=False)
    binary: io.RawIOBase | io.BufferedWriter = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=encoding, errors=errors,  # type: ignore[arg-type]
                            write_through=unbuffered,
                            line_buffering=line_buffering and not unbuffered)


def serve(sock: socket.socket, worker_name: str) -> Program | None:
    """Start workers as the agent asks and report their exits; returns None when the agent is
    gone, and, in each forked child (named ``worker_name``), the program that child is to
    run."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    template = os.getpid()
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
            session_r, session_w = os.pipe()
            try:
                pid = os.fork()
            except OSError as exc:
                for fd in (*fds, session_r, session_w):
                    os.close(fd)
                send(sock, {"started": request["start"], "error": f"fork failed: {exc}"})
                continue
            if pid == 0:
                children.clear()  # the template's to watch, not this worker's
                os.setsid()
                os.close(session_w)  # (the template waits for this: the worker's group exists)
                _name(worker_name)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, session_r):
                    os.close(fd)
                sock.close()
                program.become(template)
                return program
            children.add(pid)
            os.close(session_w)
            os.read(session_r, 1)  # EOF once the child leads its own session (or died)
            for fd in (*fds, session_r):
                os.close(fd)
            send(sock, {"started": request["start"], "pid": pid})
    finally:
        for pid in children:  # the agent is gone (or the loop failed): so are the workers
            signal_group(pid, signal.SIGKILL)


def _reap(sock: socket.socket, children: set[int]) -> None:
    """Report every worker that ended (only the workers: a preloaded module's own children are
    left to it)."""
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 255 << 8
        if done:
            children.discard(pid)
            send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def main(argv: list[str]) -> None:
    """The template process (``argv``: its agent's pid, its socket's descriptor, the workers'
    ``sys.path[0]``, the modules, then ``--`` and the worker command, there to be seen in
    ``ps``): preload the modules, say so, then serve until the agent is gone; in a forked
    child, run the worker's program."""
    die_with(int(argv[0]))
    sock = socket.socket(fileno=int(argv[1]))
    sys.path[0] = argv[2]
    modules = argv[3:argv.index("--")] if "--" in argv else argv[3:]
    worker_name = _name(TEMPLATE_NAME)
    failure = _preload(modules)
    if failure is not None:
        send(sock, {"error": failure})
        return
    send(sock, {"ready": modules})
    try:
        program = serve(sock, worker_name)
    except BrokenPipeError:  # the agent is gone
        return
    except BaseException:  # noqa: BLE001 (anything else is a bug: say it on the agent's stderr)
        traceback.print_exc()
        raise
    if program is not None:
        try:
            program.run()
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:  # noqa: BLE001 (shown as python shows it, exit code 1)
            trace = exc.__traceback__
            while trace is not None and trace.tb_frame.f_globals.get("__name__") == __name__:
                trace = trace.tb_next  # the template's own frames: not the program's
            sys.excepthook(type(exc), exc.with_traceback(trace), trace)
            raise SystemExit(1) from None
