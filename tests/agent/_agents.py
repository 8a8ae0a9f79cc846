"""Helpers of the agent tests: the agent command, bounded polling, the records of test workers."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import signal
import subprocess
from typing import Any
from _launcher import PYTHON
from _waiting import eventually as wait_for  # noqa: F401 (re-exported to the tests)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_worker.py")
JOIN = 180.0
"""Seconds for a round to form and its workers to start on a loaded machine."""


def rdzv_cli(*argv: str, module: str = "rdzv", timeout: float = 180
             ) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGV...`` (``rdzv`` as a user types it) run to its end, output captured."""
    return subprocess.run([PYTHON, "-m", module, *argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


def worker_records(out_dir: str) -> list[dict[str, Any]]:
    """Every env record written by test workers (``_worker.py``)."""
    records = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(path) as handle:
            records.append(json.load(handle))
    return records


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _state(f"/proc/{pid}/stat") not in ("Z", None)  # a zombie (not yet reaped) is dead


def _state(stat: str) -> str | None:
    """The state letter in a ``/proc/.../stat`` file; None if it cannot be read (gone)."""
    try:
        with open(stat) as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def stop(node: Any, rdzv: Any) -> None:
    """SIGSTOP an agent (``node``, a started process) at a moment it holds no lock on the file
    backend's store file: one stopped while it holds it stops every node until it resumes (as
    ``flock`` does), where the test means the others to go on. The test takes those locks
    itself, stops the agent while it holds them (until every thread of it has stopped: the
    signal stops them one by one), then lets them go."""
    paths = glob.glob(os.path.join(rdzv.endpoint, "*.rdzv")) if rdzv.backend == "file" else []
    with contextlib.ExitStack() as held:
        for path in sorted(paths):
            wait_for(lambda path=path: _lock(path, held), JOIN, f"the lock of {path}")
        node.signal(signal.SIGSTOP)
        wait_for(lambda: _stopped(node.pid), JOIN, f"every thread of pid {node.pid} stopped")


def _lock(path: str, held: contextlib.ExitStack) -> bool:
    """Whether this process now holds the lock of the store file at ``path`` (the file there
    now: a compaction replaces it by another), kept until ``held`` closes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            held.callback(os.close, fd)  # (closing it lets the lock go)
            return True
    except (BlockingIOError, FileNotFoundError):  # held, or replaced as it was looked at
        pass
    os.close(fd)
    return False


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (or gone: a process that died is no longer
    waited for; the test sees that on its own)."""
    return all(_state(stat) in ("T", "t", "Z", "X", None)  # (None: a thread that ended)
               for stat in glob.glob(f"/proc/{pid}/task/*/stat"))
