"""The public rendezvous API: RendezvousInfo, RendezvousStoreInfo, the handler ABC's defaults, exports."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading

import pytest

import rdzv
import rdzv.errors
import rdzv.rendezvous
import rdzv.store
from rdzv.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from rdzv.store import HashStore


def test_info_unpacks_as_torchs_older_tuple() -> None:
    store = HashStore()
    info = RendezvousInfo(store, 1, 4, RendezvousStoreInfo("10.0.0.1", 29500))
    got_store, rank, world_size = info
    assert (got_store, rank, world_size) == (store, 1, 4)
    assert len(info) == 3
    assert info[0] is store and info[1] == 1 and info[2] == 4 and info[-1] == 4
    assert list(info[1:]) == [1, 4]
    with pytest.raises(IndexError):
        info[3]
    assert info.store is store and info.rank == 1 and info.world_size == 4
    assert info.bootstrap_store_info == RendezvousStoreInfo("10.0.0.1", 29500)
    assert "rank=1, world_size=4" in repr(info)


def test_info_without_bootstrap_store_info() -> None:
    assert RendezvousInfo(HashStore(), 0, 1).bootstrap_store_info is None


def test_store_info_is_a_frozen_value() -> None:
    info = RendezvousStoreInfo(master_addr="h", master_port=1)
    assert (info.master_addr, info.master_port) == ("h", 1)
    assert RendezvousStoreInfo.MASTER_ADDR_KEY == "MASTER_ADDR"
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.master_port = 2  # type: ignore[misc]


class _Handler(RendezvousHandler):
    """The smallest concrete handler: rounds come from a callable, waiting nodes from a counter."""

    def __init__(self, round_maker=None, backend: str = "test") -> None:
        self.waiting = 0
        self.round_maker = round_maker or (lambda: RendezvousInfo(HashStore(), 0, 1))
        self.backend = backend

    def get_backend(self) -> str:
        return self.backend

    def next_rendezvous(self) -> RendezvousInfo:
        return self.round_maker()

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def get_run_id(self) -> str:
        return "job"

    def shutdown(self) -> bool:
        return True


def test_handler_is_abstract() -> None:
    with pytest.raises(TypeError):
        RendezvousHandler()  # type: ignore[abstract]


def test_handler_defaults() -> None:
    handler = _Handler()
    assert handler.use_agent_store is False
    assert handler.wait_for_membership_change(0.0) is False


def test_next_rendezvous_async_delivers_the_round_while_the_caller_works() -> None:
    release = threading.Event()

    def slow_round() -> RendezvousInfo:
        assert release.wait(30)
        return RendezvousInfo(HashStore(), 0, 2)

    future = _Handler(slow_round).next_rendezvous_async()
    assert not future.done()  # the caller is not blocked
    release.set()
    assert future.result(timeout=30).world_size == 2


def test_next_rendezvous_async_carries_the_error() -> None:
    def failing_round() -> RendezvousInfo:
        raise RendezvousTimeoutError("no round")

    future = _Handler(failing_round).next_rendezvous_async()
    with pytest.raises(RendezvousTimeoutError, match="no round"):
        future.result(timeout=30)


def test_default_wait_for_membership_change_sees_a_waiting_node() -> None:
    handler = _Handler()
    timer = threading.Timer(0.2, lambda: setattr(handler, "waiting", 1))
    timer.start()
    try:
        assert handler.wait_for_membership_change(30.0) is True
    finally:
        timer.cancel()
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        handler.wait_for_membership_change(-1)


def test_errors_are_reexported_from_the_one_hierarchy() -> None:
    for name in (
        "RendezvousError",
        "RendezvousClosedError",
        "RendezvousTimeoutError",
        "RendezvousConnectionError",
        "RendezvousStateError",
        "RendezvousGracefulExitError",
    ):
        assert getattr(rdzv.rendezvous, name) is getattr(rdzv.errors, name)
        assert getattr(rdzv, name) is getattr(rdzv.errors, name)


def test_public_names_are_exported_from_rdzv() -> None:
    for name in ("RendezvousHandler", "RendezvousInfo", "RendezvousParameters",
                 "RendezvousStoreInfo", "get_rendezvous_handler", "handler_registry"):
        assert getattr(rdzv, name) is getattr(rdzv.rendezvous, name)
        assert name in rdzv.__all__ and name in rdzv.rendezvous.__all__


def test_import_rdzv_loads_no_backend() -> None:
    """Built-in backends (and torch) are imported when a handler is created, not by `import rdzv`."""
    code = (
        "import json, sys, rdzv; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('rdzv.rendezvous._', "
        "'torch')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)) <= {
        "rdzv.rendezvous._api", "rdzv.rendezvous._params", "rdzv.rendezvous._registry"
    }


@pytest.mark.parametrize("backend, conf, ttl", [
    ("tcp", {}, 15.0),
    ("tcp", {"heartbeat_interval": "1", "heartbeat_misses": "5"}, 5.0),
    ("etcd", {"keep_alive_interval": "2", "keep_alive_max_attempt": "4"}, 8.0),  # torch's names
    ("file", {"heartbeat_interval": "0.5"}, 1.5),
    ("static", {}, rdzv.store.DEFAULT_SESSION_TTL),  # no heartbeats: the store's default
])
def test_the_session_ttl_is_heartbeat_interval_times_misses(backend: str, conf: dict[str, str],
                                                           ttl: float) -> None:
    """The one rule every backend's store and the agent's loss reports use."""
    endpoint = "/tmp/rdzv-ttl" if backend == "file" else "127.0.0.1:29400"
    params = rdzv.rendezvous.RendezvousParameters(backend, endpoint, "job", 1, 2, **conf)
    assert params.session_ttl == pytest.approx(ttl)
