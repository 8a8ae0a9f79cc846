"""Rendezvous nodes for tests: a handler in a child process, or in a thread of the test process.

Both kinds answer the same requests, started with ``request(op, *args)`` (returns a
:class:`Pending`) or ``call(op, *args)`` (waits for the result):

``next`` (``next_rendezvous_async()`` and its result: ``{"rank", "world_size", "addr", "port"}``),
``waiting``, ``changes`` (``round_changes()`` as ``[waiting, lost]``), ``wait_change(timeout)``, ``is_closed``, ``set_closed``, ``shutdown``,
``store_set(key, value)`` and ``store_get(key)`` (on the last round's store; missing: None).

A failed call raises :class:`NodeError` with the exception's type name. Run as
``python _nodes.py '<json spec>'`` the module is the child: the spec holds the
RendezvousParameters (``backend``, ``endpoint``, ``run_id``, ``min_nodes``, ``max_nodes``,
``local_addr`` and the backend options), and optionally ``stop_in_seal``: a file path; the
node then stops itself (a real SIGSTOP) in its first seal, after listing the joiners and before
writing its decision, once it has written the number of joiners it listed to that file (a
paused sealer: a VM freeze, a long GC pause); it goes on only once the file ``<path>.go``
exists (the test creates it, then sends SIGCONT).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
from typing import Any, Callable

if __name__ == "__main__":  # run as a node's child process: the shared test helpers are one up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _child_process import PipedChild  # noqa: E402

READY_TIMEOUT = 60.0
REPLY_TIMEOUT = 90.0


class NodeError(Exception):
    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


class Runtime:
    """A handler and its last round, executing requests."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.info: Any = None

    def execute(self, op: str, args: list[Any]) -> Any:
        h = self.handler
        if op == "next":
            self.info = h.next_rendezvous_async().result(timeout=REPLY_TIMEOUT)
            boot = self.info.bootstrap_store_info
            return {"rank": self.info.rank, "world_size": self.info.world_size,
                    "addr": boot.master_addr, "port": boot.master_port}
        if op == "waiting":
            return h.num_nodes_waiting()
        if op == "changes":
            changes = h.round_changes()
            return [changes.waiting, changes.lost]
        if op == "membership":
            view, revision = h.membership(*args)
            return [view.alive, view.waiting, view.moved, view.closed, revision]
        if op == "wait_change":
            return h.wait_for_membership_change(*args)
        if op in ("is_closed", "set_closed", "shutdown", "get_backend"):
            return getattr(h, op)()
        if op == "store_set":
            self.info.store.set(args[0], args[1])
            return None
        if op == "store_get":
            value = self.info.store.try_get(args[0])
            return None if value is None else value.decode()
        raise ValueError(f"unknown op {op!r}")


class Pending:
    """The result of a request, once it arrives."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._outcome: tuple[bool, Any] = (False, None)

    def settle(self, ok: bool, value: Any) -> None:
        self._outcome = (ok, value)
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float = REPLY_TIMEOUT) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(f"no answer within {timeout:g} s")
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def run_request(runtime: Runtime, op: str, args: list[Any], settle: Callable[[bool, Any], None]):
    """Execute one request on its own thread; its outcome goes to ``settle``."""

    def work() -> None:
        try:
            settle(True, runtime.execute(op, args))
        except Exception as exc:  # reported to the test as NodeError
            settle(False, NodeError(type(exc).__name__, str(exc)))

    threading.Thread(target=work, daemon=True, name=f"node-{op}").start()


class ThreadNode:
    """A handler of the test process (backends whose store lives in this process)."""

    def __init__(self, handler: Any) -> None:
        self.runtime = Runtime(handler)
        self.handler = handler

    def request(self, op: str, *args: Any) -> Pending:
        pending = Pending()
        run_request(self.runtime, op, list(args), pending.settle)
        return pending

    def call(self, op: str, *args: Any, timeout: float = REPLY_TIMEOUT) -> Any:
        return self.request(op, *args).result(timeout)

    def kill(self) -> None:
        """What a dead process leaves: its store connection (session) closes, nothing else."""
        store = self.handler._store
        store.close()

    def close(self) -> None:
        self.handler._store.close()


class ProcessNode(PipedChild):
    """A handler in a child process, killable with real signals."""

    def __init__(self, spec: dict[str, Any]) -> None:
        # (a node that stops itself runs in its own process group: see PipedChild)
        super().__init__(os.path.abspath(__file__), json.dumps(spec),
                         own_group="stop_in_seal" in spec)
        self._ids = itertools.count()
        self._pending: dict[int, Pending] = {}
        self._ready = Pending()
        self._write_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self._ready.settle(True, None)
                continue
            pending = self._pending.pop(message["id"])
            if "error" in message:
                pending.settle(False, NodeError(message["error"], message["message"]))
            else:
                pending.settle(True, message["result"])
        gone = NodeError("ProcessExited", f"node {self.pid} exited ({self.process.poll()})")
        self._ready.settle(False, gone)
        for pending in list(self._pending.values()):
            pending.settle(False, gone)

    def wait_ready(self) -> None:
        self._ready.result(READY_TIMEOUT)

    def request(self, op: str, *args: Any) -> Pending:
        self.wait_ready()
        pending = Pending()
        ident = next(self._ids)
        self._pending[ident] = pending
        assert self.process.stdin is not None
        with self._write_lock:
            self.process.stdin.write(json.dumps({"id": ident, "op": op, "args": args}) + "\n")
            self.process.stdin.flush()
        return pending

    def call(self, op: str, *args: Any, timeout: float = REPLY_TIMEOUT) -> Any:
        return self.request(op, *args).result(timeout)


def _stop_in_first_seal(marker: str) -> None:
    """Wrap the engine's seal step: the first seal stops this process after the listing."""
    import signal

    from rdzv.rendezvous._sealer import Sealer

    seal = Sealer._seal

    def stopping_seal(self: Any, r: int, listed: dict[str, bytes], *args: Any) -> Any:
        Sealer._seal = seal  # type: ignore[method-assign]
        with open(marker + ".tmp", "w") as out:
            out.write(str(len(listed)))
        os.rename(marker + ".tmp", marker)
        while not os.path.exists(marker + ".go"):  # a SIGCONT from elsewhere: stop again
            os.kill(os.getpid(), signal.SIGSTOP)
        return seal(self, r, listed, *args)

    Sealer._seal = stopping_seal  # type: ignore[method-assign]


def _child_main(spec: dict[str, Any]) -> None:
    from rdzv.rendezvous import RendezvousParameters, get_rendezvous_handler

    marker = spec.pop("stop_in_seal", None)
    if marker is not None:
        _stop_in_first_seal(marker)
    handler = get_rendezvous_handler(RendezvousParameters(**spec))
    runtime = Runtime(handler)
    out_lock = threading.Lock()

    def emit(message: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    emit({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        ident = request["id"]

        def settle(ok: bool, value: Any, ident: int = ident) -> None:
            if ok:
                emit({"id": ident, "result": value})
            else:
                emit({"id": ident, "error": value.type_name, "message": str(value)})

        run_request(runtime, request["op"], request["args"], settle)
    handler.shutdown()


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
