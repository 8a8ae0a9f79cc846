"""An etcd client that holds puts back until its next request and sends them with it.

A caller that writes a few keys and then reads (the rendezvous: a joiner's liveness keys, then
its look at the round) pays one round trip instead of one per put: the held puts go first in
the next unconditional transaction (they are applied before its reads, atomically), or as a
transaction of their own just before any other request or watch. Requests wait while another
thread sends held puts, so no request of this client overtakes them.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..errors import SessionExpiredError
from ._client import MAX_TXN_OPS, EtcdClient
from ._options import EtcdOptions


class WriteBehindClient(EtcdClient):
    """An :class:`EtcdClient` with :meth:`hold`: puts sent with the next request."""

    def __init__(self, options: EtcdOptions) -> None:
        super().__init__(options)
        self._held: list[dict[str, Any]] = []
        self._held_lock = threading.Lock()
        self.on_lease_lost: Callable[[str, str], None] | None = None
        """Told (lease id, why) when held puts failed because their lease is gone."""

    def hold(self, put: dict[str, Any]) -> None:
        """Send the PutRequest ``put`` with this client's next request."""
        with self._held_lock:
            self._held.append(put)

    def call(
        self, path: str, body: dict[str, Any], *, retry_ambiguous: bool = True
    ) -> dict[str, Any]:
        with self._held_lock:
            if self._held:
                return self._call_with_held(path, body, retry_ambiguous)
        return super().call(path, body, retry_ambiguous=retry_ambiguous)

    def watch(self, *creates: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
        with self._held_lock:
            if self._held:
                self._send_held([])
        return super().watch(*creates, timeout=timeout)

    def _call_with_held(
        self, path: str, body: dict[str, Any], retry_ambiguous: bool
    ) -> dict[str, Any]:
        ops = body.get("success", [])
        fits = len(self._held) + len(ops) <= MAX_TXN_OPS
        if path == "kv/txn" and not body.get("compare") and fits:
            folded = len(self._held)
            answer = self._send_held(ops, retry_ambiguous)
            answer["responses"] = answer.get("responses", [])[folded:]
            return answer
        self._send_held([])
        return super().call(path, body, retry_ambiguous=retry_ambiguous)

    def _send_held(
        self, ops: list[dict[str, Any]], retry_ambiguous: bool = True
    ) -> dict[str, Any]:
        """One transaction: the held puts, then ``ops`` (the caller holds the lock).

        Puts are idempotent: a transaction of puts alone is re-sent if its answer is lost."""
        held, self._held = self._held, []
        body = {"success": [{"request_put": put} for put in held] + ops}
        try:
            return super().call("kv/txn", body, retry_ambiguous=retry_ambiguous)
        except SessionExpiredError as exc:
            leases = {put["lease"] for put in held if "lease" in put}
            if self.on_lease_lost is not None:
                for lease in leases:
                    self.on_lease_lost(lease, str(exc))
            raise
