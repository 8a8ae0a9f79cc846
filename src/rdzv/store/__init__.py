"""Key-value stores with torch.distributed.Store's API: in-process, file, TCP and prefix views."""

from ._base import (
    DEFAULT_SESSION_TTL,
    DEFAULT_TIMEOUT,
    Store,
    StoreCapabilities,
)
from ._etcd import EtcdStore
from ._file import FileStore
from ._hash import HashStore
from ._prefix import PrefixStore
from ._tcp import TCPStore

__all__ = [
    "DEFAULT_SESSION_TTL",
    "DEFAULT_TIMEOUT",
    "EtcdStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "StoreCapabilities",
    "TCPStore",
]
