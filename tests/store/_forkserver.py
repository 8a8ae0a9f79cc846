"""Store peers forked from a warm process: a peer whose client needs torch (the torch adapter's
contract) would spend ~3 s of CPU importing it, for each of the ~50 peers of a run.

Run as ``python _forkserver.py MODULE``: it imports ``MODULE`` (and with it torch), then reads one
request per line on stdin, ``{"spec": {...}, "in": FIFO, "out": FIFO}``, forks a peer that serves
``spec`` as ``_child.py`` does over those two named pipes, and answers ``{"pid": N}``. It reaps
its peers as they end, and ends when its stdin closes. :class:`ForkedProcess` is the test's side
of one peer, with the part of ``subprocess.Popen`` that :class:`_child_process.PipedChild` uses.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, TextIO

SCRIPT = os.path.abspath(__file__)
_servers: dict[str, subprocess.Popen[str]] = {}
_lock = threading.Lock()


class ForkedProcess:
    """A peer forked by the warm process (not a child of this one: its exit is seen on a pidfd,
    its code is not known)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        module = spec["factory"].partition(":")[0]
        folder = tempfile.mkdtemp(prefix="rdzv-peer-")
        paths = os.path.join(folder, "in"), os.path.join(folder, "out")
        for path in paths:
            os.mkfifo(path)
        with _lock:
            server = _server(module)
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps({"spec": spec, "in": paths[0], "out": paths[1]}) + "\n")
            server.stdin.flush()
            self.pid = int(json.loads(server.stdout.readline())["pid"])
        self._pidfd: int | None = _pidfd(self.pid)
        # (the peer opens them in this order too: once it reads, it opens its output at once)
        try:
            self.stdin = _writer(paths[0], self.pid)
        except BaseException:
            if self._pidfd is not None:
                os.close(self._pidfd)
            raise
        self.stdout = open(paths[1])  # noqa: SIM115 (closed by the peer's owner)
        for path in paths:
            os.unlink(path)
        os.rmdir(folder)

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        if self._pidfd is not None:  # readable once the peer has ended
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"peer {self.pid}", timeout or 0.0)
            os.close(self._pidfd)
            self._pidfd = None
        return 0

    def send_signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _pidfd(pid: int) -> int | None:
    """A descriptor of the peer that no later process can reuse (None: it has already ended)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _writer(path: str, pid: int, within: float = 60.0) -> TextIO:
    """The peer's input, opened once the peer has opened it to read (bounded: a peer that died
    first never does)."""
    deadline = time.monotonic() + within
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise TimeoutError(f"peer {pid} did not open its input within {within:g} s "
                                   f"({exc})") from exc
            time.sleep(0.005)
    os.set_blocking(fd, True)
    return open(fd, "w")  # noqa: SIM115 (closed by the peer's owner)


def _server(module: str) -> subprocess.Popen[str]:
    server = _servers.get(module)
    if server is None or server.poll() is not None:
        server = subprocess.Popen([sys.executable, SCRIPT, module], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        _servers[module] = server
    return server


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        if server.stdin is not None:
            server.stdin.close()  # (it ends; its peers were ended by their tests)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def _reap(*_: Any) -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _peer(request: dict[str, Any]) -> None:
    """In the forked process: serve the spec over the two pipes, then end at once."""
    from _child import serve_spec

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    stdin = os.open(request["in"], os.O_RDONLY)
    stdout = os.open(request["out"], os.O_WRONLY)
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    try:
        serve_spec(request["spec"])
    finally:
        sys.stdout.flush()
        os._exit(0)


def main() -> None:
    from _child import prepare

    prepare()
    __import__(sys.argv[1])  # (torch with it: what every peer would import)
    signal.signal(signal.SIGCHLD, _reap)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _peer(request)
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    main()
