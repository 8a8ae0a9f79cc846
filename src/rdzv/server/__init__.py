"""The rdzv store server: the store served over TCP (``rdzv serve``, or embedded in a process).

:class:`StoreServer` serves a store to :class:`rdzv.TCPStore` clients over the protocol in
:mod:`rdzv.kv.protocol` (specified in ``docs/protocol.md``; :mod:`rdzv.server.protocol` names it
too). The server is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..kv.protocol import DEFAULT_MAX_FRAME_SIZE, PROTOCOL_VERSION

if TYPE_CHECKING:
    from ._server import StoreServer

__all__ = ["DEFAULT_MAX_FRAME_SIZE", "PROTOCOL_VERSION", "StoreServer"]


def __getattr__(name: str) -> Any:
    if name == "StoreServer":
        from ._server import StoreServer

        return StoreServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
