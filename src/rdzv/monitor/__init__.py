"""The live web view of runs and their Prometheus metrics (``--web`` of ``rdzv serve`` and
``rdzv status``).

:class:`MonitorServer` serves one page (the runs; for one run its state, members, waiting
nodes, a chart of its world size over time with the events marked, the table of events), the
JSON it polls, and ``/metrics`` in Prometheus' text format, all read-only, from a
:class:`RunSource` (the runs of one store, read through a store client). Everything the page
needs ships in this package: it makes no request to another host. ``/metrics`` needs
``prometheus_client`` (``pip install 'rdzv[monitor]'``); this package imports without it.
See ``docs/monitor.md``.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:  # (the names a type checker sees; at run time they load on first use)
    from ..errors import SourceUnavailable as SourceUnavailable
    from ._cli import DEFAULT_HOST as DEFAULT_HOST
    from ._cli import add_web_flag as add_web_flag
    from ._cli import monitor_run as monitor_run
    from ._cli import monitor_store_server as monitor_store_server
    from ._cli import parse_web_address as parse_web_address
    from ._cli import serve_until_interrupted as serve_until_interrupted
    from ._http import MonitorServer as MonitorServer
    from ._prometheus import MonitorCollector as MonitorCollector
    from ._prometheus import RunTotals as RunTotals
    from ._prometheus import require_prometheus as require_prometheus
    from ._source import RunSource as RunSource

_EXPORTS = {
    **{name: "._cli" for name in (
        "DEFAULT_HOST", "add_web_flag", "monitor_run", "monitor_store_server", "parse_web_address",
        "serve_until_interrupted",
    )},
    "MonitorServer": "._http",
    **{name: "._prometheus" for name in ("MonitorCollector", "require_prometheus")},
    "RunSource": "._source",
    "SourceUnavailable": "..errors",
    "RunTotals": "._prometheus",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
