"""The ``etcd`` backend: dynamic rendezvous on an etcd v3 cluster (torch: ``etcd``/``etcd-v2``).

The endpoint lists one or more ``HOST:PORT`` of the cluster's members (requests fail over between
them). Every node has its own :class:`EtcdStore` under ``<etcd_prefix>/``; its ephemeral keys
carry the node's etcd lease, kept alive every ttl/3 seconds, so a killed or hung node's keys
vanish ``heartbeat_interval x heartbeat_misses`` seconds (at least 2) after its last keep-alive,
and at once when it shuts down (the lease is revoked). Waiting nodes block on etcd watches.

TLS: ``protocol=https`` with ``ca_cert`` and optionally ``ssl_cert``/``ssl_cert_key`` (torch's
``cacert``/``cert``/``key`` work too). Authentication: the environment variables
``RDZV_ETCD_USER`` and ``RDZV_ETCD_PASSWORD`` (kept out of URLs and command lines).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import RendezvousParameterError
from ..store._etcd import EtcdStore
from ._api import RendezvousParameters
from ._engine import DynamicRendezvousHandler

logger = logging.getLogger(__name__)

USER_ENV = "RDZV_ETCD_USER"
PASSWORD_ENV = "RDZV_ETCD_PASSWORD"

_TLS_OPTIONS = ("protocol", "ca_cert", "ssl_cert", "ssl_cert_key")


class RendezvousEtcdStore(EtcdStore):
    """An EtcdStore whose :meth:`revision` costs one request: the revision etcd is at now.

    The engine only uses ``revision(path)`` as the ``since`` of a later ``watch(path, since)``
    after reading the state it depends on. etcd's current revision is at or after the last
    change of every path, so a watch from it misses no change that follows the read, without
    scanning etcd's history for deletions (what the exact :meth:`EtcdStore.revision` does, once
    per path and client: a fresh round's directory would cost every node a scan of the whole
    history).
    """

    def revision(self, path: str = "") -> int:
        answer = self.client.call("kv/range", {**self._range(path), "count_only": True})
        return int(answer["header"]["revision"])


def key_prefix(etcd_prefix: str) -> str:
    """The store prefix of ``etcd_prefix``: ``"/rdzv"`` -> ``"/rdzv/"``; ``""`` or ``"/"``: ``"/"``."""
    return etcd_prefix.rstrip("/") + "/"


def store_options(params: RendezvousParameters) -> dict[str, Any]:
    """The EtcdStore keywords of ``params``: TLS files, credentials, timeouts, session ttl."""
    options: dict[str, Any] = {
        name: params.get_option(name)
        for name in _TLS_OPTIONS
        if params.get_option(name) is not None
    }
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if (user is None) != (password is None):
        raise RendezvousParameterError(
            f"etcd authentication needs both {USER_ENV} and {PASSWORD_ENV} in the environment "
            f"(only {USER_ENV if user is not None else PASSWORD_ENV} is set)"
        )
    if user is not None:
        options.update(user=user, password=password)
    read_timeout = params.get_option("read_timeout")
    options.update(
        timeout=read_timeout,
        request_timeout=min(10.0, read_timeout),
        retry_timeout=read_timeout,
        session_ttl=params.get_option("heartbeat_interval") * params.get_option("heartbeat_misses"),
    )
    return options


def open_store(params: RendezvousParameters) -> RendezvousEtcdStore:
    """This node's etcd client, checked to reach etcd (a typed error naming the endpoints)."""
    if not params.endpoint:
        raise RendezvousParameterError(
            "the etcd rendezvous backend needs the etcd endpoints as HOST:PORT[,HOST:PORT...], "
            "e.g. etcd://10.0.0.1:2379/job-42?nnodes=2:4"
        )
    options = store_options(params)
    try:
        return RendezvousEtcdStore(
            params.endpoint, prefix=key_prefix(params.get_option("etcd_prefix")), **options
        )
    except ValueError as exc:  # EtcdOptions: a bad endpoint, TLS file or option combination
        raise RendezvousParameterError(
            f"bad etcd rendezvous settings for {params.endpoint!r}: {exc}"
        ) from exc


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    store = open_store(params)
    logger.debug("etcd rendezvous %s on %s under %r", params.run_id, params.endpoint, store.prefix)
    return DynamicRendezvousHandler(
        store,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        backend=params.backend,
        local_addr=params.local_addr,
        join_timeout=params.get_option("join_timeout"),
        last_call_timeout=params.get_option("last_call_timeout"),
        on_shutdown=store.close,
    )
