"""The ``etcd`` backend: dynamic rendezvous on an etcd v3 cluster (torch: ``etcd``/``etcd-v2``).

The endpoint lists one or more ``HOST:PORT`` of the cluster's members (requests fail over between
them). Every node has its own :class:`EtcdStore` under ``<etcd_prefix>/``; its ephemeral keys
carry the node's etcd lease, kept alive every ttl/3 seconds, so a killed or hung node's keys
vanish ``heartbeat_interval x heartbeat_misses`` seconds (at least 2) after its last keep-alive,
and at once when it shuts down (the lease is revoked). Waiting nodes block on etcd watches.

TLS: ``protocol=https`` with ``ca_cert`` and optionally ``ssl_cert``/``ssl_cert_key`` (torch's
``cacert``/``cert``/``key`` work too). Authentication: the options ``user`` and ``password`` or
``password_file``, each else the environment variable ``RDZV_ETCD_USER`` / ``RDZV_ETCD_PASSWORD``
(so that no secret needs to appear in a URL or command line).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence, cast

from ..errors import (
    RendezvousParameterError,
    SessionExpiredError,
    StoreAuthenticationError,
)
from ..etcd import EtcdCompactedError, WriteBehindClient, b64, unb64
from ..store import EtcdStore, Reads, Timeout, Value, to_bytes, to_seconds
from ._api import RendezvousParameters
from ._backend import dynamic_handler
from ._engine import DynamicRendezvousHandler
from ._layout import control_dir_round, is_sealer_lock, parse_joiner_key

logger = logging.getLogger(__name__)

USER_ENV = "RDZV_ETCD_USER"
PASSWORD_ENV = "RDZV_ETCD_PASSWORD"

_TLS_OPTIONS = ("protocol", "ca_cert", "ssl_cert", "ssl_cert_key")


class RendezvousEtcdStore(EtcdStore):
    """An EtcdStore tuned for the engine's access pattern: one request per step, none a retry.

    * A revision read (:meth:`revision`, or one in :meth:`read_many`) is the revision etcd is at
      now. The engine only uses ``revision(path)`` as the ``since`` of a later ``watch(path,
      since)``, read before (or with) the state it depends on; any revision etcd reached then
      is at or after the last change that state can show, so the watch misses no change that
      follows it, and no node scans etcd's history for deletions (what the exact
      :meth:`EtcdStore.revision` does once per path).
    * A joiner's ephemeral keys (its descriptor, its liveness for the next round, its "back"
      mark) are held back and sent with its next request (:class:`WriteBehindClient`): that is
      its first look at the round, one transaction that puts them and then reads the round
      (it counts itself, as before). A node that dies in between had written nothing, as if it
      died before its puts; an error of the puts (its lease expired) is raised by that request.
    * A joiner's watch of its round's ``ctl/`` directory also watches its own rank key (one
      stream, two watches): the sealer's write of the rank wakes it with the value, which the
      engine's next read of that key gets without a request. A rank key is written once per
      round, by the sealer, so the value seen is the one a read would return.
    * A lost lease is noticed, not waited out. A joiner whose process was stopped (or cut off
      from etcd) longer than the lease ttl has lost its descriptor with the lease: its look at
      the round also reads that key, and its watch also watches it for a deletion, so either
      raises SessionExpiredError (and drops the dead lease) instead of waiting in a round that
      no longer counts it; the engine then joins again as a new node. A sealer's decision (and
      the lock's release with it) is one transaction on the lock still holding its node id
      (:meth:`EtcdStore.multi_set_if`), and a release without a decision is one too: a sealer
      that lost the lock to the lease's expiry (and so perhaps to a newer sealer) writes
      nothing.
    """

    client_type = WriteBehindClient

    _rank: str | None = None
    """The rank key of this client's last arrival (:meth:`RunKeys.rank`)."""
    _node: str | None = None
    """The descriptor key of this client's last arrival (:meth:`RunKeys.node`): its write
    names the round and node id of the arrival."""
    _delivered: tuple[str, bytes] | None = None
    """A rank key and its value, brought by a watch, for the next :meth:`try_get` of it."""
    _sealer: tuple[str, bytes] | None = None
    """The sealer lock this client took and the node id it holds it with."""

    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        if self._sealer is not None and key == self._sealer[0]:
            return self._release(*self._sealer)
        joiner = parse_joiner_key(key) if ephemeral else None
        if joiner is None:
            return super().set(key, value, ephemeral=ephemeral)
        if joiner.kind == "nodes":
            self._node = key
            self._rank = joiner.rank_key
        client = cast(WriteBehindClient, self.client)
        if client.on_lease_lost is None:
            client.on_lease_lost = lambda lease, why: self.session.lost(lease, why, reported=True)
        client.hold(self._put(self.etcd_key(key), to_bytes(value), self._lease(True)))

    def compare_set(
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        result = super().compare_set(key, expected, desired, ephemeral=ephemeral)
        if ephemeral and result and result == to_bytes(desired) and is_sealer_lock(key):
            self._sealer = (key, result)
        return result

    def _release(self, lock: str, holder: bytes) -> None:
        """Empty the sealer lock if this node still holds it (a quiet write that keeps the
        lock's lease); a lock lost to the lease's expiry may be another node's by now."""
        self._sealer = None
        k = b64(self.etcd_key(lock))
        self.client.call("kv/txn", {
            "compare": [{"key": k, "target": "VALUE", "result": "EQUAL", "value": b64(holder)}],
            "success": [{"request_put": {"key": k, "value": "", "ignore_lease": True}}],
        })  # fmt: skip

    def read_many(
        self,
        keys: Sequence[str] = (),
        counts: Sequence[str] = (),
        revisions: Sequence[str] = (),
        lists: Sequence[str] = (),
    ) -> Reads:
        node = self._node
        if node is None or node[: node.rindex("/") + 1] not in counts:
            return super().read_many(keys, counts, revisions, lists)
        # A joiner's look at its round: is its own descriptor (its lease) still there?
        reads = super().read_many([*keys, node], counts, revisions, lists)
        if reads.values.pop(node) is None:
            raise self._descriptor_lost(node)
        return reads

    def _descriptor_lost(self, node: str) -> SessionExpiredError:
        self._node = None
        return self._lease_lost(f"its descriptor {node!r} is gone", "it is no longer in its round")

    def _lease_lost(self, what: str, outcome: str) -> SessionExpiredError:
        """The error for a key of this node's lease found gone; the lease is dropped, so the
        next ephemeral write gets a new one."""
        reason = (
            f"this node's etcd lease expired ({what}: the process was stopped or cut "
            f"off from etcd longer than the lease ttl of {self.session.ttl} s, "
            f"heartbeat_interval x heartbeat_misses); {outcome}"
        )
        self.session.forget(reason)
        return SessionExpiredError(reason)

    def _revision_read(self, path: str) -> dict[str, Any]:
        return {**self._range(path), "count_only": True}

    def _revision_from(self, path: str, answer: dict[str, Any], current: int) -> int:
        return current

    def try_get(self, key: str) -> bytes | None:
        delivered, self._delivered = self._delivered, None
        if delivered is not None and delivered[0] == key:
            return delivered[1]  # this joiner's rank, brought by the watch that woke it
        return super().try_get(key)

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        round_path = control_dir_round(path)
        if round_path is None:
            return super().watch(path, since, timeout)
        seconds = to_seconds(timeout, self._timeout)
        if seconds <= 0:
            return int(since)
        rank = self._rank if self._rank and self._rank.startswith(round_path) else None
        node = self._node if self._node and self._node.startswith(round_path) else None
        start = int(since) + 1
        creates = [{**self._range(path), "start_revision": start}]
        if rank is not None:
            creates.append({"key": b64(self.etcd_key(rank)), "start_revision": start})
        if node is not None:  # its deletion: this node's lease expired
            creates.append({"key": b64(self.etcd_key(node)), "start_revision": start,
                            "filters": ["NOPUT"]})  # fmt: skip
        try:
            events = self.client.watch(*creates, timeout=seconds)
        except EtcdCompactedError:  # EtcdStore.watch reports it as a change
            return super().watch(path, since, 0)
        if not events:
            return int(since)
        if node is not None and any(unb64(e["kv"]["key"]) == self.etcd_key(node) for e in events):
            raise self._descriptor_lost(node)
        if rank is not None:
            self._deliver(rank, events)
        return max(int(e["kv"]["mod_revision"]) for e in events)

    def _deliver(self, rank: str, events: list[dict[str, Any]]) -> None:
        """Keep this joiner's rank if ``events`` wrote it, for the engine's next read of it."""
        key = self.etcd_key(rank)
        for event in events:
            if event.get("type") != "DELETE" and unb64(event["kv"]["key"]) == key:
                self._delivered = (rank, unb64(event["kv"].get("value")))


def key_prefix(etcd_prefix: str) -> str:
    """The store prefix of ``etcd_prefix``: ``"/rdzv"`` -> ``"/rdzv/"``, ``""`` -> ``"/"``."""
    return etcd_prefix.rstrip("/") + "/"


def _credentials(params: RendezvousParameters) -> tuple[str, str] | None:
    """``(user, password)`` from the options ``user`` and ``password``/``password_file``, each
    else from the environment; None when neither a user nor a password is given anywhere."""
    user = params.get_option("user") or os.environ.get(USER_ENV) or None
    given = {
        name: params.get_option(name)
        for name in ("password", "password_file")
        if params.get_option(name)
    }
    if len(given) > 1:
        raise RendezvousParameterError(
            "the etcd rendezvous options password and password_file were both given: give one"
        )
    if "password_file" in given:
        password: str | None = _read_password(given["password_file"])
    else:
        password = given.get("password") or os.environ.get(PASSWORD_ENV) or None
    if user is None and password is None:
        return None
    if user is None:
        raise RendezvousParameterError(
            f"an etcd password was given but no user: set the rendezvous option user=NAME "
            f"or the environment variable {USER_ENV}"
        )
    if password is None:
        raise RendezvousParameterError(
            f"etcd user {user!r} was given without a password: set the rendezvous option "
            f"password_file=PATH (or password=...) or the environment variable {PASSWORD_ENV}"
        )
    return user, password


def _read_password(path: str) -> str:
    """The password in file ``path`` without its trailing newline; a parameter error if the
    file cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            password = f.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise RendezvousParameterError(
            f"cannot read the etcd password_file {path!r}: {exc}"
        ) from exc
    if not password:
        raise RendezvousParameterError(
            f"the etcd password_file {path!r} is empty: write the etcd user's password into it"
        )
    return password


def store_options(params: RendezvousParameters) -> dict[str, Any]:
    """The EtcdStore keywords of ``params``: TLS files, credentials, timeouts, session ttl."""
    options: dict[str, Any] = {
        name: params.get_option(name)
        for name in _TLS_OPTIONS
        if params.get_option(name) is not None
    }
    credentials = _credentials(params)
    if credentials is not None:
        options.update(user=credentials[0], password=credentials[1])
    read_timeout = params.get_option("read_timeout")
    ttl = params.session_ttl
    options.update(
        timeout=read_timeout,
        # A keep-alive stuck on a hung member must move on well before the lease expires.
        request_timeout=min(10.0, read_timeout, max(1.0, ttl / 3)),
        retry_timeout=read_timeout,
        session_ttl=ttl,
    )
    return options


def open_store(params: RendezvousParameters, *, lease: bool = True) -> RendezvousEtcdStore:
    """This node's etcd client, checked to reach etcd (a typed error naming the endpoints).
    ``lease``: take the node's lease now (a reader such as ``rdzv status`` needs none)."""
    if not params.endpoint:
        raise RendezvousParameterError(
            "the etcd rendezvous backend needs the etcd endpoints as HOST:PORT[,HOST:PORT...], "
            "e.g. etcd://10.0.0.1:2379/job-42?nnodes=2:4"
        )
    options = store_options(params)
    try:
        store = RendezvousEtcdStore(
            params.endpoint, prefix=key_prefix(params.get_option("etcd_prefix")), **options
        )
    except ValueError as exc:  # EtcdOptions: a bad endpoint, TLS file or option combination
        raise RendezvousParameterError(
            f"bad etcd rendezvous settings for {params.endpoint!r}: {exc}"
        ) from exc
    except StoreAuthenticationError as exc:  # the first request: credentials or permissions
        who = f"as etcd user {options['user']!r}" if "user" in options else "without a user"
        raise StoreAuthenticationError(
            f"{exc}. The rendezvous connected {who}: its etcd credentials are the options "
            f"user and password_file (or password), else the environment variables "
            f"{USER_ENV} and {PASSWORD_ENV}"
        ) from exc
    if not lease:
        return store
    try:
        store.session.id()  # the node's lease now, not on the rendezvous' critical path
    except BaseException:
        store.close()
        raise
    return store


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    store = open_store(params)
    logger.debug("etcd rendezvous %s on %s under %r", params.run_id, params.endpoint, store.prefix)
    return dynamic_handler(store, params, on_shutdown=store.close)
