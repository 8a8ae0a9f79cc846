"""rdzv: rendezvous for elastic distributed training.

The public names are re-exported here; the sub-packages show the architecture:
``rdzv.store`` (key-value stores), ``rdzv.server`` (the embedded store server),
``rdzv.rendezvous`` (handlers and backends), ``rdzv.cli`` (the ``rdzv`` command).
"""

from ._version import __version__
from .errors import (
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
    StoreValueError,
)
from .store import FileStore, HashStore, PrefixStore, Store, StoreCapabilities, TCPStore
from .rendezvous import (
    RendezvousHandler,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    get_rendezvous_handler,
    handler_registry,
    parse_rendezvous_url,
    rendezvous_url,
)

__all__ = [
    "__version__",
    "FileStore",
    "HashStore",
    "PrefixStore",
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
    "SessionExpiredError",
    "Store",
    "StoreAuthenticationError",
    "StoreCapabilities",
    "StoreConnectionError",
    "StoreError",
    "StoreProtocolError",
    "StoreTimeoutError",
    "StoreValueError",
    "TCPStore",
    "get_rendezvous_handler",
    "handler_registry",
    "parse_rendezvous_url",
    "rendezvous_url",
]
