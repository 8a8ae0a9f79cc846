"""A client session on etcd: one lease, granted on first use and kept alive by a daemon thread.

Keys written with the lease are ephemeral: etcd deletes them when the lease is revoked
(:meth:`EtcdLease.revoke`, on close) or when ``ttl`` seconds pass without a keep-alive (the
process died or hung, or lost every etcd endpoint).
"""

from __future__ import annotations

import logging
import math
import threading

from ..errors import SessionExpiredError, StoreError
from ._client import EtcdClient

logger = logging.getLogger(__name__)

MIN_TTL = 2
"""etcd refuses shorter leases (its minimum is 1.5 election timeouts)."""


class EtcdLease:
    """The lease of one store client; thread safe."""

    def __init__(self, client: EtcdClient, ttl: float) -> None:
        if not ttl > 0:
            raise ValueError(f"session_ttl must be > 0 seconds, got {ttl!r}")
        self.ttl = max(MIN_TTL, math.ceil(ttl))
        self._client = client
        self._lock = threading.Lock()
        self._id: str | None = None
        self._lost: tuple[str, str] | None = None
        """(lease id, why) of a loss found by the keep-alive and not yet reported."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def id(self) -> str:
        """The lease id, granting the lease on first use.

        Raises SessionExpiredError once after the lease was lost (the keys written with it are
        gone); the next call grants a new lease.
        """
        with self._lock:
            if self._lost is not None:
                (_, reason), self._lost = self._lost, None
                raise SessionExpiredError(
                    f"this client's etcd lease expired ({reason}): its ephemeral keys were "
                    "deleted; write them again to register anew"
                )
            if self._stop.is_set():
                raise SessionExpiredError("the store is closed: its etcd lease was revoked")
            if self._id is None:
                answer = self._client.call("lease/grant", {"TTL": self.ttl})
                self._id = str(answer["ID"])
                self._thread = threading.Thread(
                    target=self._keep_alive, args=(self._id,), name="rdzv-etcd-lease", daemon=True
                )
                self._thread.start()
                logger.debug("granted etcd lease %s (ttl %d s)", self._id, self.ttl)
            return self._id

    def forget(self, reason: str) -> None:
        """The caller found the lease gone (its keys deleted) and reports it: drop the lease
        and any loss not yet reported, so the next :meth:`id` grants a new lease."""
        with self._lock:
            if self._id is not None:
                logger.warning("etcd lease %s lost: %s", self._id, reason)
            self._id, self._lost = None, None

    def lost(self, lease_id: str, reason: str, *, reported: bool = False) -> None:
        """Record that ``lease_id`` no longer exists (etcd said so).

        Unless the caller already ``reported`` it (raised SessionExpiredError), the next
        :meth:`id` raises it. A report of a loss the keep-alive found first cancels that
        loss's pending report: the caller learns of one lost lease once.
        """
        with self._lock:
            if self._id == lease_id:
                logger.warning("etcd lease %s lost: %s", lease_id, reason)
                self._id = None
                self._lost = None if reported else (lease_id, reason)
            elif reported and self._lost is not None and self._lost[0] == lease_id:
                self._lost = None

    def _keep_alive(self, lease_id: str) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:
                if self._id != lease_id:
                    return
            try:
                answer = self._client.call("lease/keepalive", {"ID": lease_id})
            except SessionExpiredError as exc:
                self.lost(lease_id, str(exc))
                return
            except StoreError as exc:
                logger.warning("etcd lease %s keep-alive failed: %s", lease_id, exc)
                continue
            if int(answer.get("result", {}).get("TTL", 0)) <= 0:
                self.lost(lease_id, f"not renewed within {self.ttl} s")
                return

    def revoke(self, timeout: float = 10.0) -> None:
        """Stop the keep-alive and revoke the lease, deleting its keys at once."""
        self._stop.set()
        with self._lock:
            lease_id, self._id = self._id, None
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if lease_id is not None:
            try:
                self._client.call("lease/revoke", {"ID": lease_id})
            except SessionExpiredError:
                pass
            except StoreError as exc:
                logger.warning(
                    "could not revoke etcd lease %s (%s): its keys vanish after %d s",
                    lease_id,
                    exc,
                    self.ttl,
                )
