"""The etcd the rendezvous tests run on (one per etcd version found, per test module), and
process nodes on a fresh key prefix of it: shared by the contract on etcd
(``test_etcd_backend_contract.py``) and what only the etcd backend has (``test_etcd_backend.py``),
two files so that the two run on two pytest workers."""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any, Iterator

import pytest

from _clusters import ProcessCluster

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "etcd"))
from etcd_testing import etcd_params, require_etcd  # noqa: E402

from rdzv.etcd import LocalEtcd  # noqa: E402
from rdzv.rendezvous._etcd import key_prefix  # noqa: E402
from rdzv.store import EtcdStore  # noqa: E402

HUNG = {"heartbeat_interval": 1.0, "heartbeat_misses": 4}
"""A 4 s lease: a SIGSTOPped node's keys vanish about 4 s after it stops."""
SHORT_LEASE = {"heartbeat_interval": 2.0, "heartbeat_misses": 3}
"""The contract's nodes: a killed node's keys vanish 6 s after its last keep-alive (long
enough that a live node's keep-alives, every 2 s, survive a heavily loaded machine, as the
4 s leases of :data:`HUNG` do)."""


@pytest.fixture(scope="module", params=etcd_params())
def etcd_binary(request: pytest.FixtureRequest) -> str:
    return require_etcd(request.param)


@pytest.fixture(scope="module")
def etcd_server(etcd_binary: str) -> Iterator[LocalEtcd]:
    with LocalEtcd(binary=etcd_binary) as server:
        yield server


def fresh_prefix() -> str:
    return f"/rdzv-test-{uuid.uuid4().hex[:10]}"


class EtcdCluster(ProcessCluster):
    """Process nodes on a fresh ``etcd_prefix`` of one etcd (a fresh store for each test)."""

    def __init__(self, endpoint: str, **defaults: Any) -> None:
        prefix = fresh_prefix()
        super().__init__(
            "etcd", endpoint,
            raw_store=lambda: EtcdStore(endpoint, prefix=key_prefix(prefix), timeout=30),
            hung_options=HUNG, etcd_prefix=prefix, read_timeout=30.0,
            **{**SHORT_LEASE, **defaults},
        )
