"""Peers for the store contract: another client in a child process, or in a thread.

A test drives a peer with ``request(op, *args)`` (start a call without waiting), ``reply()``
(its result) or ``call(op, *args)`` (both). A failed call raises :class:`PeerError` carrying the
exception's type name, the same for both kinds of peer. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from typing import Any

from _child import call_op, decode, encode
from _child_process import PipedChild
from _forkserver import ForkedProcess

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
READY_TIMEOUT = 60.0
"""Seconds a child may take to import and open its client (torch imports slowly)."""
REPLY_TIMEOUT = 60.0


class PeerError(Exception):
    """A peer's call raised ``type_name``."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


class ProcessPeer(PipedChild):
    """A child process (``_child.py``) with its own client, opened from a JSON spec."""

    def __init__(self, spec: dict[str, Any]) -> None:
        """``spec["warm"]``: forked from a process that has imported the factory's module (see
        ``_forkserver``), for a client that needs torch."""
        process = ForkedProcess(spec) if spec.get("warm") else None
        super().__init__(CHILD_SCRIPT, json.dumps(spec), process=process)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._ready = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"child {self.pid} did not answer within {timeout:g} s") from None
        if line is None:
            raise RuntimeError(f"child {self.pid} exited (code {self.process.poll()})")
        return json.loads(line)

    def wait_ready(self) -> None:
        if not self._ready:
            assert self._next(READY_TIMEOUT) == {"ready": True}
            self._ready = True

    def request(self, op: str, *args: Any, **kwargs: Any) -> None:
        assert self.process.stdin is not None
        message = {"op": op, "args": encode(list(args)), "kwargs": encode(kwargs)}
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def reply(self, timeout: float = REPLY_TIMEOUT) -> Any:
        self.wait_ready()
        answer = self._next(timeout)
        if "error" in answer:
            raise PeerError(answer["error"], answer["message"])
        return decode(answer["result"])

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        self.request(op, *args, **kwargs)
        return self.reply()


class ThreadPeer:
    """Another client of an in-process store, answering from a thread of its own."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._requests: queue.Queue[tuple[str, tuple, dict] | None] = queue.Queue()
        self._replies: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            op, args, kwargs = request
            try:
                result = call_op(self.client, op, list(args), kwargs)
                self._replies.put((True, result))
            except Exception as exc:  # re-raised in the test thread as PeerError
                self._replies.put((False, PeerError(type(exc).__name__, str(exc))))

    def wait_ready(self) -> None:
        """A thread peer is ready at once."""

    def request(self, op: str, *args: Any, **kwargs: Any) -> None:
        self._requests.put((op, args, kwargs))

    def reply(self, timeout: float = REPLY_TIMEOUT) -> Any:
        try:
            ok, result = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"thread peer did not answer within {timeout:g} s") from None
        if not ok:
            raise result
        return result

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        self.request(op, *args, **kwargs)
        return self.reply()

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join(timeout=10)


Peer = ProcessPeer | ThreadPeer
