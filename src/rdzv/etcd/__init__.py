"""etcd support: options for reaching a cluster, a stdlib JSON-gateway client and local servers.

The store itself is :class:`rdzv.store.EtcdStore`; this package holds what it builds on
(:class:`EtcdOptions`, :class:`EtcdClient`; :class:`EtcdLease` and :class:`WriteBehindClient`,
imported on first use) and :class:`LocalEtcd` / :class:`LocalEtcdCluster`, real etcd servers on
loopback for tests and demos.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ._binary import EtcdNotFoundError, etcd_version, find_etcd_binaries, find_etcd_binary
from ._client import (
    MAX_TXN_OPS,
    EtcdAmbiguousError,
    EtcdClient,
    EtcdCompactedError,
    b64,
    prefix_range_end,
    unb64,
)
from ._local import EtcdTLSFiles, LocalEtcd, LocalEtcdCluster, LocalEtcdError
from ._options import EtcdOptions, parse_endpoints

if TYPE_CHECKING:  # (the names a type checker sees; at run time they load on first use)
    from ._lease import EtcdLease as EtcdLease
    from ._writebehind import WriteBehindClient as WriteBehindClient

_EXPORTS = {"EtcdLease": "._lease", "WriteBehindClient": "._writebehind"}

__all__ = [
    "MAX_TXN_OPS",
    "EtcdAmbiguousError",
    "EtcdClient",
    "EtcdCompactedError",
    "EtcdLease",
    "EtcdNotFoundError",
    "EtcdOptions",
    "EtcdTLSFiles",
    "LocalEtcd",
    "LocalEtcdCluster",
    "LocalEtcdError",
    "WriteBehindClient",
    "b64",
    "etcd_version",
    "find_etcd_binaries",
    "find_etcd_binary",
    "parse_endpoints",
    "prefix_range_end",
    "unb64",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
