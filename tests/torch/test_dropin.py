"""rdzv as a drop-in for torch: torch 2.13's behaviour next to rdzv's on the same input.

Each test runs the same calls against torch's object and rdzv's and asserts that a user sees the
same thing (class of error, the words torch uses, the result). The differences that remain on
purpose are listed in ``docs/torch.md``.
"""

from __future__ import annotations

import gc
import os
import pickle
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns that numpy is missing
    import torch.distributed as dist
from torch.distributed.elastic.rendezvous import api as torch_api
from torch.distributed.elastic.rendezvous import utils as torch_utils

import rdzv
from rdzv._address import parse_endpoint
from rdzv.agent import ConfigError, parse_rdzv_conf
from rdzv.rendezvous._tcp import split_endpoint
from rdzv.store import FileStore, HashStore, PrefixStore, TCPStore
from rdzv.torch import TorchStore
from rdzv.torch._handler import rdzv_parameters

SHORT = timedelta(seconds=0.3)


def outcome(call: Callable[[], Any]) -> Any:
    """What the user sees of ``call()``: its result, or ("error", ValueError/...) ."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - compared between torch and rdzv
        for kind in (ValueError, TypeError, RuntimeError):
            if isinstance(exc, kind):
                return ("error", kind)
        raise


# -- 1. constructor arguments ----------------------------------------------------------------

def test_tcp_store_world_size_zero_is_refused_at_once_by_both() -> None:
    with pytest.raises(ValueError, match="TCPStore world size cannot be 0"):
        dist.TCPStore("127.0.0.1", 0, 0, True, SHORT)
    with pytest.raises(ValueError, match="TCPStore world size cannot be 0"):
        TCPStore("127.0.0.1", 0, 0, True, SHORT)


def test_prefix_store_of_none_is_refused_by_both() -> None:
    with pytest.raises(ValueError, match="store argument cannot be None"):
        dist.PrefixStore("p", None)
    with pytest.raises(ValueError, match="store argument cannot be None"):
        PrefixStore("p", None)  # type: ignore[arg-type]


# -- 2. timeouts -------------------------------------------------------------------------------

def test_timeouts_are_dist_store_errors_saying_timeout() -> None:
    torch_store = dist.TCPStore("127.0.0.1", 0, 1, True, SHORT)
    ours = TorchStore(TCPStore("127.0.0.1", 0, is_master=True, timeout=SHORT))
    try:
        for store in (torch_store, ours):
            with pytest.raises(dist.DistStoreError, match=r"^wait timeout after 300ms, keys: \S*k"):
                store.get("k")
            with pytest.raises(dist.DistStoreError, match="wait timeout after"):
                store.wait(["k"], SHORT)
        with pytest.raises(rdzv.StoreTimeoutError) as info:  # rdzv's own class too
            ours.get("k")
        assert type(info.value).__name__ == "StoreTimeoutError"
        copy = pickle.loads(pickle.dumps(info.value))  # (e.g. sent back by a worker pool)
        assert isinstance(copy, dist.DistStoreError) and copy.keys == ("k",)
    finally:
        ours.close()


def test_waiting_for_workers_reads_like_torchs() -> None:
    with pytest.raises(dist.DistStoreError) as theirs:
        dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=0.5))
    with pytest.raises(rdzv.StoreTimeoutError) as ours:
        TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=0.5))
    words = "waiting for clients. 1/2 clients joined."
    assert words in str(theirs.value) and words in str(ours.value)


# -- 3. and 4. endpoints and --rdzv-conf ----------------------------------------------------------

ENDPOINTS = ["", "  ", "localhost", "node-0", "node-0:1234", "10.0.0.1:29400", "[::1]",
             "[::1]:5", "host:", "host:port", "host:65536", "host:-1", "~", "~:1",
             "dummy.com :123", ":123", "a b:1", "h:1:2x", "under_score:7"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_endpoints_parse_as_torchs(endpoint: str) -> None:
    """The same (host, port), or a ValueError, for every endpoint, as torch's
    parse_rendezvous_endpoint (an empty endpoint is localhost:29400)."""
    theirs = outcome(lambda: torch_utils.parse_rendezvous_endpoint(endpoint, 29400))
    assert outcome(lambda: parse_endpoint(endpoint, 29400)) == theirs
    assert outcome(lambda: split_endpoint(endpoint)) == theirs


def test_torchrun_plugin_takes_an_empty_endpoint_as_localhost_29400() -> None:
    """torchrun passes --rdzv-endpoint's default, "", to the rdzv-tcp creator."""
    params = torch_api.RendezvousParameters("rdzv-tcp", "", "job", 1, 1)
    assert split_endpoint(rdzv_parameters(params).endpoint) == ("localhost", 29400)
    assert torch_utils.parse_rendezvous_endpoint("", 29400) == ("localhost", 29400)


@pytest.mark.parametrize("conf", ["", "a=1", " a = 1 , b=2 ", "a=1,,c=2", "a=", "a", "=1",
                                  "a=1,", ",a=1", "a=b=c"])
def test_rdzv_conf_parses_as_torchs(conf: str) -> None:
    theirs = outcome(lambda: torch_utils._parse_rendezvous_config(conf))
    ours = outcome(lambda: parse_rdzv_conf(conf))
    assert ours == theirs
    if isinstance(theirs, tuple):  # refused by both: torch's words first
        with pytest.raises(ConfigError, match="--rdzv-conf: The rendezvous configuration"):
            parse_rdzv_conf(conf)


# -- 5. multi_tenant ---------------------------------------------------------------------------

@pytest.mark.parametrize("make", [dist.TCPStore, TCPStore], ids=["torch", "rdzv"])
def test_multi_tenant_masters_share_a_port(make: Callable[..., Any]) -> None:
    first = make("127.0.0.1", 0, None, True, timedelta(seconds=5), multi_tenant=True)
    second = make("127.0.0.1", first.port, None, True, timedelta(seconds=5), multi_tenant=True)
    first.set("k", "v")
    assert second.get("k") == b"v"
    with pytest.raises((RuntimeError, OSError), match="(?i)address already in use"):
        make("127.0.0.1", first.port, None, True, timedelta(seconds=5))
    for store in (first, second):
        if hasattr(store, "close"):
            store.close()


# -- 6. queues -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "make",
    [lambda: dist.HashStore(), lambda: TorchStore(HashStore()), lambda: HashStore()],
    ids=["torch HashStore", "rdzv TorchStore", "rdzv HashStore"],
)
def test_queues_behave_as_torchs(make: Callable[[], Any]) -> None:
    store = make()
    store.set_timeout(SHORT)
    assert store.queue_len("q") == 0
    store.queue_push("q", "a")
    store.queue_push("q", b"b")
    assert store.queue_len("q") == 2
    assert [store.queue_pop("q"), store.queue_pop("q", False)] == [b"a", b"b"]
    with pytest.raises(RuntimeError, match="queue is empty"):
        store.queue_pop("q", False)
    with pytest.raises(RuntimeError, match="(?i)timeout"):
        store.queue_pop("q")
    if not isinstance(store, HashStore):  # what torch code catches
        with pytest.raises(dist.QueueEmptyError):
            store.queue_pop("q", False)
        with pytest.raises(dist.DistStoreError):
            store.queue_pop("q")


# -- 7. a FileStore dropped without close() ----------------------------------------------------

@pytest.mark.parametrize("make", [dist.FileStore, FileStore], ids=["torch", "rdzv"])
def test_dropped_file_stores_delete_their_file(make: Callable[..., Any], tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    first, second = make(path, 2), make(path, 2)
    first.set("k", "v")
    del first
    gc.collect()
    assert os.path.exists(path) and second.get("k") == b"v"
    del second
    gc.collect()
    assert not os.path.exists(path)


# -- 8. the handler registry ---------------------------------------------------------------------

class _OtherBackend(torch_api.RendezvousHandler):
    def get_backend(self) -> str:
        return "other"

    def next_rendezvous(self) -> Any:
        raise NotImplementedError

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None: ...

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "job"

    def shutdown(self) -> bool:
        return True


class _OurOtherBackend(rdzv.RendezvousHandler):
    get_backend = _OtherBackend.get_backend
    next_rendezvous = _OtherBackend.next_rendezvous
    is_closed = _OtherBackend.is_closed
    set_closed = _OtherBackend.set_closed
    num_nodes_waiting = _OtherBackend.num_nodes_waiting
    get_run_id = _OtherBackend.get_run_id
    shutdown = _OtherBackend.shutdown


def test_a_handler_of_another_backend_is_a_runtime_error_in_both() -> None:
    theirs = torch_api.RendezvousHandlerRegistry()
    theirs.register("asked", lambda params: _OtherBackend())
    ours = rdzv.RendezvousHandlerRegistry()
    ours.register("asked", lambda params: _OurOtherBackend())
    words = "The rendezvous backend 'other' does not match the requested backend 'asked'."
    with pytest.raises(RuntimeError, match=words):
        theirs.create_handler(torch_api.RendezvousParameters("asked", "h:1", "job", 1, 1))
    with pytest.raises(RuntimeError, match=words):
        ours.create_handler(rdzv.RendezvousParameters("asked", "h:1", "job", 1, 1))
