"""The ``file`` backend: dynamic rendezvous on a FileStore in a directory every node shares.

The endpoint is a directory (NFS, Lustre, or local for one machine); run ``<run>`` keeps its
store in ``<endpoint>/<run>.rdzv``. The FileStore has no change notification (capability
``watch=False``): waiting nodes use its bounded polling ``watch`` (1 ms backing off to 50 ms),
so a round costs each node a few file reads per wait rather than one message. A node's liveness
is its session file (locked while its process lives, touched as a heartbeat): a killed node is
noticed at the next poll, a hung one after ``heartbeat_interval x heartbeat_misses`` seconds.
"""

from __future__ import annotations

import os

from ..store import FileStore
from ._api import RendezvousParameters
from ._backend import dynamic_handler
from ._engine import DynamicRendezvousHandler


def store_path(directory: str, run_id: str) -> str:
    return os.path.join(directory, f"{run_id}.rdzv")


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """A handler on ``<endpoint>/<run_id>.rdzv`` (the directory is created if missing)."""
    directory = params.endpoint
    if not directory:
        raise ValueError(
            "the file rendezvous backend needs a directory shared by every node as its "
            "endpoint, e.g. file:///shared/rdzv/job-42"
        )
    os.makedirs(directory, exist_ok=True)
    store = FileStore(
        store_path(directory, params.run_id),
        timeout=params.get_option("read_timeout"),
        session_ttl=params.session_ttl,
    )
    return dynamic_handler(store, params, on_shutdown=store.close)
