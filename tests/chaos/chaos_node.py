"""One node of the chaos soak, a process of its own: ``python chaos_node.py '<json spec>'``.

It loops until its deadline: ``next_rendezvous()``, writes its name under its rank in the
round's store and reads the whole member set back, then "trains" in steps, each a
``wait_for_membership_change()`` of a random while plus a ``num_nodes_waiting()``, and goes back
to the rendezvous on a change. Everything it sees goes to its own append-only JSON-lines history
(see chaos_checks). It leaves gracefully once the harness creates its leave file: a member
calls ``announce_leaving()`` and ``shutdown()``; a node waiting for a round (a spare) exits.
With the pause file armed, the first node to seal a round after it appears stops itself
(SIGSTOP) right after listing the joiners, in the middle of the seal: the harness resumes it
later, past the session ttl (the stale sealer of issue 17).

rdzv is imported from wherever ``PYTHONPATH`` points first (to soak another source tree).

Spec keys: ``url``, ``name``, ``history``, ``seed``, ``deadline`` (wall clock), ``step``
([min, max] seconds), ``members_timeout``, ``leave_file``, ``pause_file``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import rdzv.rendezvous as rendezvous
from rdzv.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
    SessionExpiredError,
    StoreTimeoutError,
)
from rdzv.rendezvous._sealer import Sealer

EXPECTED = (SessionExpiredError, RendezvousConnectionError, RendezvousTimeoutError,
            RendezvousStateError)
"""What faults may raise in a node: its session lost (paused past the ttl), the store away or
slow (a server restart, an etcd election), a decision refused as stale (the fence)."""
REJOIN_PAUSE = 0.2
SPARE_POLL = 0.3


class History:
    """Append-only JSON lines, one ``os.write`` per event (a SIGKILL loses no written event)."""

    def __init__(self, path: str, name: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._name = name
        self._lock = threading.Lock()

    def record(self, ev: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "node": self._name, "pid": os.getpid(), "ev": ev,
                           **fields}) + "\n"
        with self._lock:
            os.write(self._fd, line.encode())


def arm_seal_pause(pause_file: str, history: History) -> None:
    """Wrap the engine's private seal step (test code only): with ``pause_file`` present, the
    first node to get there removes it, records ``seal_pause`` and stops itself."""
    seal: Callable[..., Any] = Sealer._seal

    def paused_seal(self: Sealer, r: int, listed: Any, *args: Any,
                    **kwargs: Any) -> Any:
        try:
            os.unlink(pause_file)
        except FileNotFoundError:
            return seal(self, r, listed, *args, **kwargs)
        history.record("seal_pause", round=r, listed=len(listed), node_id=self.node_id)
        os.kill(os.getpid(), signal.SIGSTOP)
        return seal(self, r, listed, *args, **kwargs)

    Sealer._seal = paused_seal  # type: ignore[method-assign]


class Node:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.history = History(spec["history"], self.name)
        self.rng = random.Random(spec["seed"])
        self.deadline: float = spec["deadline"]
        self.handler = rendezvous.get_rendezvous_handler(spec["url"])

    def leaving(self) -> bool:
        return os.path.exists(self.spec["leave_file"])

    def run(self) -> int:
        while time.time() < self.deadline:
            try:
                if self.leaving():
                    return self.leave()
                if not self.round():
                    return 0
            except EXPECTED as exc:
                self.failed(exc, expected=True)
            except Exception as exc:  # recorded as a violation; the node goes on
                self.failed(exc, expected=False)
        return 0

    def round(self) -> bool:
        """One rendezvous and the training in it, until a membership change; False once the
        rendezvous is closed."""
        info = self.wait_for_round()
        if info is None:
            return False
        r = self.handler._member.round  # the round number is not part of torch's API
        self.history.record("joined", round=r, rank=info.rank, world=info.world_size,
                            node_id=self.handler.node_id)
        self.cross_check(r, info)
        self.train(r)
        return True

    def wait_for_round(self) -> Any:
        self.history.record("waiting", node_id=self.handler.node_id)
        done = threading.Event()
        watcher = threading.Thread(target=self.watch_spare, args=(done,), daemon=True)
        watcher.start()
        try:
            return self.handler.next_rendezvous()
        except RendezvousClosedError:
            self.history.record("closed")
            return None
        finally:
            done.set()
            watcher.join()

    def watch_spare(self, done: threading.Event) -> None:
        """Record when this waiting node becomes a spare (or stops being one), or joins again
        under a new node id (its session expired); leave when told to."""
        is_spare = getattr(self.handler, "is_spare", lambda: False)  # rdzv before spares: none
        spare, node_id = False, self.handler.node_id
        while not done.wait(SPARE_POLL):
            if self.leaving():  # not a member: nothing to announce; the process just ends
                self.history.record("left", announced=False)
                os._exit(0)
            if time.time() > self.deadline:  # a spare waits without a timeout: bounded here
                os._exit(0)
            now = (is_spare(), self.handler.node_id)
            if now != (spare, node_id):
                spare, node_id = now
                self.history.record("spare" if spare else "waiting", node_id=node_id)

    def cross_check(self, r: int, info: Any) -> None:
        """Every member writes its name under its rank in the round's store and reads the
        others back: the member set as the round's store holds it."""
        store = info.store
        mine = f"rank/{info.rank}"
        holder = store.compare_set(mine, "", self.name).decode()
        keys = [f"rank/{i}" for i in range(info.world_size)]
        members: list[str | None]
        try:
            store.wait(keys, self.spec["members_timeout"])
            members = [value.decode() for value in store.multi_get(keys)]
        except StoreTimeoutError:
            members = [None if value is None else value.decode()
                       for value in map(store.try_get, keys)]
        self.history.record("members", round=r, members=members,
                            conflict=None if holder == self.name else holder)

    def train(self, r: int) -> None:
        """Steps of a random while until the membership changes (or the leave file appears)."""
        low, high = self.spec["step"]
        while time.time() < self.deadline and not self.leaving():
            changed = self.handler.wait_for_membership_change(self.rng.uniform(low, high))
            waiting = self.handler.num_nodes_waiting()
            if changed:
                return
            self.history.record("step", round=r, waiting=waiting)

    def leave(self) -> int:
        """A graceful leave: announce it, then shut down and exit."""
        announced = self.handler.announce_leaving()
        self.handler.shutdown()
        self.history.record("left", announced=announced)
        return 0

    def failed(self, exc: BaseException, *, expected: bool) -> None:
        """Record the exception; start over with a new handler (a new node id and session)."""
        self.history.record("error", type=type(exc).__name__, expected=expected,
                            message=str(exc)[:300],
                            trace=None if expected else traceback.format_exc()[-2000:])
        try:
            self.handler.shutdown()
        except Exception as exc2:  # the store may be away: the new handler will tell
            self.history.record("error", type=type(exc2).__name__, expected=True,
                                message=f"shutdown after an error: {exc2}"[:300])
        pause = REJOIN_PAUSE
        while time.time() < self.deadline:
            time.sleep(pause)
            try:
                self.handler = rendezvous.get_rendezvous_handler(self.spec["url"])
                return
            except EXPECTED as exc3:
                self.history.record("error", type=type(exc3).__name__, expected=True,
                                    message=f"reconnecting: {exc3}"[:300])
                pause = 1.0


def main() -> int:
    spec = json.loads(sys.argv[1])
    node = Node(spec)
    if spec.get("pause_file"):
        arm_seal_pause(spec["pause_file"], node.history)
    return node.run()


if __name__ == "__main__":
    sys.exit(main())
