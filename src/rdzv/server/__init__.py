"""The rdzv store server: the store served over TCP (``rdzv serve``, or embedded in a process).

:class:`StoreServer` serves a store to :class:`rdzv.TCPStore` clients over the protocol in
:mod:`rdzv.kv.protocol` (specified in ``docs/protocol.md``; :mod:`rdzv.server.protocol` names it
too). The server, its memory budget and its metrics are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from ..kv.protocol import DEFAULT_MAX_FRAME_SIZE, PROTOCOL_VERSION

if TYPE_CHECKING:  # (the names a type checker sees; at run time they load on first use)
    from ._budget import DEFAULT_MEMORY_BUDGET as DEFAULT_MEMORY_BUDGET
    from ._metrics import Histogram as Histogram
    from ._metrics import HistogramSnapshot as HistogramSnapshot
    from ._metrics import ServerMetricsSnapshot as ServerMetricsSnapshot
    from ._server import StoreServer as StoreServer

_EXPORTS = {
    "DEFAULT_MEMORY_BUDGET": "._budget",
    **{name: "._metrics" for name in ("Histogram", "HistogramSnapshot", "ServerMetricsSnapshot")},
    "StoreServer": "._server",
}

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "DEFAULT_MEMORY_BUDGET",
    "PROTOCOL_VERSION",
    "Histogram",
    "HistogramSnapshot",
    "ServerMetricsSnapshot",
    "StoreServer",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
