"""etcd support: options for reaching a cluster, a stdlib JSON-gateway client and local servers.

The store itself is :class:`rdzv.store.EtcdStore`; this package holds what it builds on
(:class:`EtcdOptions`, :class:`EtcdClient`) and :class:`LocalEtcd` /
:class:`LocalEtcdCluster`, real etcd servers on loopback for tests and demos.
"""

from ._binary import EtcdNotFoundError, etcd_version, find_etcd_binaries, find_etcd_binary
from ._client import EtcdClient
from ._local import EtcdTLSFiles, LocalEtcd, LocalEtcdCluster, LocalEtcdError
from ._options import EtcdOptions, parse_endpoints

__all__ = [
    "EtcdClient",
    "EtcdNotFoundError",
    "EtcdOptions",
    "EtcdTLSFiles",
    "LocalEtcd",
    "LocalEtcdCluster",
    "LocalEtcdError",
    "etcd_version",
    "find_etcd_binaries",
    "find_etcd_binary",
    "parse_endpoints",
]
