"""A child Python process the tests drive with JSON lines and real signals (SIGKILL, SIGSTOP)."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any


class PipedChild:
    """``python SCRIPT ARGS...`` with pipes on stdin and stdout; subclasses speak its protocol."""

    def __init__(self, script: str, *args: str, own_group: bool = False,
                 process: Any = None) -> None:
        """``own_group``: run the child in a process group of its own, for a child that stops
        itself (SIGSTOP): a stopped process in an orphaned group (as the test's may be, run
        from a background job) gets SIGHUP and SIGCONT from the kernel as soon as any process
        of that group exits; its own group, whose parent (this process) is in another group of
        the same session, is never orphaned. ``process``: one started already, with Popen's
        ``stdin``, ``stdout``, ``pid``, ``poll``, ``wait``, ``send_signal`` and ``kill``."""
        self.process = process or subprocess.Popen(
            [sys.executable, script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            process_group=0 if own_group else None,
        )
        self._stopped = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL the child: no cleanup runs, its connections and locks just vanish."""
        if self._stopped:
            self.resume()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGSTOP the child: alive but hung, its heartbeats stop."""
        self.process.send_signal(signal.SIGSTOP)
        self._stopped = True

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self._stopped = False

    def tell_to_end(self) -> None:
        """Close the child's input, its sign to end (without waiting: see :meth:`close`)."""
        if self.process.poll() is None:
            if self._stopped:
                self.resume()
            assert self.process.stdin is not None
            try:
                self.process.stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        """End the child by closing its input (killed if it does not exit within 10 s). Many
        children end together when each is told first (torch's exit takes most of a second)."""
        self.tell_to_end()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def end_together(children: "list[PipedChild]") -> None:
    """End ``children`` at once: each is told first, then each awaited (torch's exit takes most
    of a second; told one by one, many children end one by one)."""
    for child in children:
        child.tell_to_end()
    for child in children:
        child.close()
