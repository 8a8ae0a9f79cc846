"""Rendezvous handlers and backends, with the names of ``torch.distributed.elastic.rendezvous``.

``get_rendezvous_handler("tcp://host:29400/job-42?nnodes=2:4")`` (or a
:class:`RendezvousParameters`) creates the handler of a backend; backends are imported only
when used. See ``docs/rendezvous.md`` for the URL forms and each backend's options.
"""

from ..errors import (
    RendezvousBackendError,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousParameterError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from ._api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from ._history import (
    DEFAULT_HISTORY_SIZE,
    EVENT_KINDS,
    RESTART_CAUSES,
    EventLog,
    EventWriter,
    RunEvent,
    read_events,
)
from ._registry import (
    ENTRY_POINT_GROUP,
    RendezvousHandlerCreator,
    RendezvousHandlerRegistry,
    get_rendezvous_handler,
    handler_registry,
    parse_rendezvous_url,
    rendezvous_url,
)
from ._params import canonical_backend
from ._timeline import format_event
from ._views import MembershipView, RoundChanges

__all__ = [
    "DEFAULT_HISTORY_SIZE",
    "ENTRY_POINT_GROUP",
    "RESTART_CAUSES",
    "EVENT_KINDS",
    "EventLog",
    "EventWriter",
    "MembershipView",
    "RendezvousBackendError",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousParameterError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "RoundChanges",
    "RunEvent",
    "canonical_backend",
    "format_event",
    "get_rendezvous_handler",
    "handler_registry",
    "parse_rendezvous_url",
    "read_events",
    "rendezvous_url",
]
