"""Rendezvous handlers and backends, with the names of ``torch.distributed.elastic.rendezvous``.

``get_rendezvous_handler("tcp://host:29400/job-42?nnodes=2:4")`` (or a
:class:`RendezvousParameters`) creates the handler of a backend; backends are imported only
when used. See ``docs/rendezvous.md`` for the URL forms and each backend's options.

The engine, the run status read by ``rdzv status`` and the agent, and the node's port are
imported on first use (``rdzv.rendezvous.read_status``).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
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
    events_dir,
    read_events,
)
from ._layout import (
    AGENT_ABANDON,
    AGENT_ALIVE,
    AGENT_ASSIGN,
    AGENT_CTL,
    AGENT_DECISION,
    AGENT_DIR,
    AGENT_DONE,
    AGENT_EVICT,
    AGENT_HINT,
    AGENT_LEAVING,
    AGENT_NEXT,
    AGENT_NODES,
    AGENT_READY,
    AGENT_RESTARTING,
    AGENT_SEEN,
    AGENT_STRAGGLERS,
    ROOT,
    RunKeys,
    abandon_key,
    assign_key,
    ready_key,
    restarting_key,
    record_key,
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
from ._params import backend_spec, canonical_backend
from ._timeline import format_event, parse_since
from ._views import MembershipView, RoundChanges

if TYPE_CHECKING:  # (the names a type checker sees; at run time they load on first use)
    from ._engine import DynamicRendezvousHandler as DynamicRendezvousHandler
    from ._history_facts import why_lost as why_lost
    from ._node import PortReservation as PortReservation
    from ._status import RunStatus as RunStatus
    from ._status import format_status as format_status
    from ._status import open_store as open_store
    from ._status import read_status as read_status
    from ._status import unknown_run as unknown_run

_EXPORTS = {
    "DynamicRendezvousHandler": "._engine",
    "why_lost": "._history_facts",
    "PortReservation": "._node",
    **{name: "._status" for name in (
        "RunStatus", "format_status", "open_store", "read_status", "unknown_run",
    )},
}

__all__ = [
    "AGENT_ABANDON",
    "AGENT_ALIVE",
    "AGENT_ASSIGN",
    "AGENT_CTL",
    "AGENT_DECISION",
    "AGENT_DIR",
    "AGENT_DONE",
    "AGENT_EVICT",
    "AGENT_HINT",
    "AGENT_LEAVING",
    "AGENT_NEXT",
    "AGENT_NODES",
    "AGENT_READY",
    "AGENT_RESTARTING",
    "AGENT_SEEN",
    "AGENT_STRAGGLERS",
    "DEFAULT_HISTORY_SIZE",
    "DynamicRendezvousHandler",
    "ENTRY_POINT_GROUP",
    "RESTART_CAUSES",
    "EVENT_KINDS",
    "EventLog",
    "EventWriter",
    "MembershipView",
    "PortReservation",
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
    "ROOT",
    "RoundChanges",
    "RunEvent",
    "RunKeys",
    "RunStatus",
    "backend_spec",
    "canonical_backend",
    "events_dir",
    "format_event",
    "format_status",
    "get_rendezvous_handler",
    "handler_registry",
    "open_store",
    "parse_rendezvous_url",
    "parse_since",
    "read_events",
    "read_status",
    "rendezvous_url",
    "unknown_run",
    "why_lost",
    "abandon_key",
    "assign_key",
    "ready_key",
    "restarting_key",
    "record_key",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
