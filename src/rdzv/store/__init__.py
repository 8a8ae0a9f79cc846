"""Key-value stores with torch.distributed.Store's API: in-process, file, TCP, etcd and prefix views.

The implementations are imported on first use (``rdzv.store.TCPStore``), so importing the
package costs only the Store interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..kv import DEFAULT_SESSION_TTL
from ._base import (
    DEFAULT_TIMEOUT,
    Conditions,
    Reads,
    Store,
    StoreCapabilities,
    Timeout,
    Value,
    check_key,
    to_bytes,
    to_seconds,
)

if TYPE_CHECKING:
    from ._etcd import EtcdStore
    from ._file import FileStore
    from ._hash import HashStore
    from ._prefix import PrefixStore
    from ._tcp import TCPStore

_EXPORTS = {
    "EtcdStore": "._etcd",
    "FileStore": "._file",
    "HashStore": "._hash",
    "PrefixStore": "._prefix",
    "TCPStore": "._tcp",
}

__all__ = [
    "Conditions",
    "DEFAULT_SESSION_TTL",
    "DEFAULT_TIMEOUT",
    "EtcdStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Reads",
    "Store",
    "StoreCapabilities",
    "TCPStore",
    "Timeout",
    "Value",
    "check_key",
    "to_bytes",
    "to_seconds",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
