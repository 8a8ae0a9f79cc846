"""rdzv: rendezvous for elastic distributed training.

The public names are re-exported here (imported on first access, so `import rdzv` stays
fast); the sub-packages show the architecture:
``rdzv.store`` (key-value stores), ``rdzv.server`` (the embedded store server),
``rdzv.rendezvous`` (handlers and backends), ``rdzv.cli`` (the ``rdzv`` command).
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from ._version import __version__
from .errors import (
    QueueEmptyError,
    RendezvousBackendError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousParameterError,
    RendezvousStateError,
    RendezvousTimeoutError,
    SessionExpiredError,
    StoreAuthenticationError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreTimeoutError,
    StoreUnsupportedError,
    StoreValueError,
)
if TYPE_CHECKING:
    from .rendezvous import (
        EventLog,
        EventWriter,
        RendezvousHandler,
        RendezvousHandlerRegistry,
        RendezvousInfo,
        RendezvousParameters,
        RendezvousStoreInfo,
        RunEvent,
        get_rendezvous_handler,
        handler_registry,
        parse_rendezvous_url,
        read_events,
        rendezvous_url,
    )
    from .server import StoreServer
    from .store import EtcdStore, FileStore, HashStore, PrefixStore, Store, StoreCapabilities, TCPStore

_EXPORTS = {
    **{name: ".store" for name in (
        "EtcdStore", "FileStore", "HashStore", "PrefixStore", "Store", "StoreCapabilities", "TCPStore"
    )},
    **{name: ".rendezvous" for name in (
        "EventLog",
        "EventWriter",
        "RendezvousHandler",
        "RendezvousHandlerRegistry",
        "RendezvousInfo",
        "RendezvousParameters",
        "RendezvousStoreInfo",
        "RunEvent",
        "get_rendezvous_handler",
        "handler_registry",
        "parse_rendezvous_url",
        "read_events",
        "rendezvous_url",
    )},
    "StoreServer": ".server",
}

__all__ = [
    "__version__",
    "EtcdStore",
    "EventLog",
    "EventWriter",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "QueueEmptyError",
    "RendezvousBackendError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousParameterError",
    "RendezvousHandler",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStoreInfo",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "RunEvent",
    "SessionExpiredError",
    "Store",
    "StoreServer",
    "StoreAuthenticationError",
    "StoreCapabilities",
    "StoreConnectionError",
    "StoreError",
    "StoreProtocolError",
    "StoreTimeoutError",
    "StoreUnsupportedError",
    "StoreValueError",
    "TCPStore",
    "get_rendezvous_handler",
    "handler_registry",
    "parse_rendezvous_url",
    "read_events",
    "rendezvous_url",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
