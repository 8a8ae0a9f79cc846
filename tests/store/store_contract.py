"""The Store contract: what every Store implementation must do, with torch's semantics.

Subclass :class:`StoreContract` in a ``test_*.py`` module of ``tests/store`` (import it with
``from contract import StoreContract``) and give the subclass a fixture ``store_factory`` that
yields an object with:

* ``new_client() -> Store``: a new client of one shared store, fresh and empty for each test
  (the first call opens "the" store); the factory closes every client at teardown;
* ``child_spec() -> dict | None``: ``{"factory": "package.module:callable", "kwargs": {...}}``
  with which ``_child.py`` opens its own client of that store in another process, or None for
  in-process stores (then "other process" tests use a thread with ``new_client()``);
* ``bad_constructions() -> list[(call, exception type, message regex)]``: constructor calls
  with malformed arguments, each of which must fail at once (no connecting, no waiting);
* optionally ``session_ttl: float``: the heartbeat time-to-live of the child's clients (small,
  e.g. 2 s), which enables the test that a SIGSTOPped child's ephemeral keys expire;
* optionally ``blocked() -> int``: a count that rises once a call of any client (in this
  process or a peer's) blocks in the store (the calls waiting now, as a server holds them, or
  the looks a polling client took in vain); the tests of a call woken by another client then
  write once the call waits, instead of at once.

Tests of a capability the store does not declare are skipped, naming the capability.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

import pytest

from _child_process import end_together
from _peers import PeerError, ProcessPeer, ThreadPeer

from rdzv.errors import QueueEmptyError, StoreTimeoutError, StoreUnsupportedError, StoreValueError
from rdzv.store import PrefixStore, Store, StoreCapabilities
from _waiting import eventually

CLIENT_TIMEOUT = 30.0
"""The timeout of the test's clients: long enough for a loaded machine, short enough to fail."""
SHORT = 0.2
"""Seconds for calls that are expected to time out."""
EXPIRY_BOUND = 45.0
"""Seconds within which a dead or hung client's ephemeral keys must disappear."""




def owner(store: Store) -> Store:
    """The client that owns ``store``'s session: a PrefixStore view is owned by its base."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


class OnceBlocked(threading.Thread):
    """Runs ``action`` in a thread of its own once a call blocks in the store (the factory's
    ``blocked()`` rises above its count when this is made), or at once where the factory cannot
    tell; :meth:`join` raises if no call was seen blocking (the action runs anyway)."""

    def __init__(self, store_factory: Any, action: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.count: Callable[[], int] | None = getattr(store_factory, "blocked", None)
        self.before = self.count() if self.count is not None else 0
        self.action = action
        self.error: AssertionError | None = None
        self.start()

    def run(self) -> None:
        count = self.count
        if count is not None:
            try:
                eventually(lambda: count() > self.before, CLIENT_TIMEOUT / 2,
                           "a call blocked in the store")
            except AssertionError as exc:
                self.error = exc
        self.action()

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


class StoreContract:
    """The contract tests; pytest collects them through ``Test*`` subclasses only."""

    # -- fixtures ---------------------------------------------------------------------------
    @pytest.fixture
    def store(self, store_factory: Any) -> Store:
        client = store_factory.new_client()
        client.set_timeout(CLIENT_TIMEOUT)
        return client

    @pytest.fixture
    def client(self, store_factory: Any, store: Store) -> Store:
        """A second client of the same store."""
        other = store_factory.new_client()
        other.set_timeout(CLIENT_TIMEOUT)
        return other

    @pytest.fixture
    def spawn(self, store_factory: Any, store: Store) -> Iterator[Callable[[], Any]]:
        """Start peers: child processes, or threads for in-process stores."""
        peers: list[Any] = []

        def start() -> Any:
            spec = store_factory.child_spec()
            if spec is None:
                other = store_factory.new_client()
                other.set_timeout(CLIENT_TIMEOUT)
                peers.append(ThreadPeer(other))
            else:
                peers.append(ProcessPeer(spec))
            return peers[-1]

        yield start
        end_together([peer for peer in peers if isinstance(peer, ProcessPeer)])
        for peer in peers:
            if isinstance(peer, ThreadPeer):
                peer.close()

    @pytest.fixture
    def child(self, store_factory: Any, spawn: Callable[[], Any]) -> ProcessPeer:
        """A peer in another process (skipped for in-process stores)."""
        if store_factory.child_spec() is None:
            pytest.skip("capability multi_process: the store lives inside one process")
        peer = spawn()
        peer.wait_ready()
        return peer

    @staticmethod
    def require(store: Store, capability: str) -> None:
        if not getattr(store.capabilities, capability):
            pytest.skip(f"capability {capability}: not declared by {type(store).__name__}")

    # -- capabilities, lifecycle ----------------------------------------------------------
    def test_capabilities_are_declared(self, store: Store) -> None:
        assert isinstance(store.capabilities, StoreCapabilities)

    def test_malformed_constructor_arguments_fail_at_once(self, store_factory: Any) -> None:
        """As torch's stores refuse world_size=0 at once: every malformed argument is refused
        before connecting or waiting, with a message that names it."""
        for call, error, message in store_factory.bad_constructions():
            started = time.monotonic()
            with pytest.raises(error, match=message):
                call()
            assert time.monotonic() - started < 5.0, f"{message!r} took its time to fail"

    def test_close_twice_and_context_manager(self, store_factory: Any) -> None:
        client = store_factory.new_client()
        with client as entered:
            assert entered is client
        client.close()

    # -- set / get --------------------------------------------------------------------------
    def test_set_get_str_and_bytes_return_bytes(self, store: Store) -> None:
        store.set("s", "text é")
        store.set("b", b"\x00\xff binary")
        store.set("ba", bytearray(b"array"))
        assert store.get("s") == "text é".encode()
        assert store.get("b") == b"\x00\xff binary"
        assert store.get("ba") == b"array"
        assert isinstance(store.get("s"), bytes)

    def test_set_overwrites_and_empty_value(self, store: Store) -> None:
        store.set("k", "one")
        store.set("k", "two")
        assert store.get("k") == b"two"
        store.set("empty", b"")
        assert store.get("empty") == b""
        assert store.check(["empty"])

    def test_large_value_and_odd_keys(self, store: Store) -> None:
        big = bytes(range(256)) * 4096
        store.set("big", big)
        assert store.get("big") == big
        for key in ("ünï/cödé", "a b\tc", "/leading", "trailing/", "x" * 1000):
            store.set(key, key)
            assert store.get(key) == key.encode()

    def test_value_visible_to_other_client(self, store: Store, client: Store) -> None:
        store.set("k", "v")
        assert client.get("k") == b"v"

    def test_get_woken_by_other_client(
        self, store: Store, client: Store, store_factory: Any
    ) -> None:
        writer = OnceBlocked(store_factory, lambda: client.set("late", "value"))
        assert store.get("late") == b"value"
        writer.join(10)

    def test_get_woken_by_other_process(
        self, store: Store, spawn: Callable[[], Any], store_factory: Any
    ) -> None:
        peer = spawn()
        peer.wait_ready()
        setter = OnceBlocked(store_factory, lambda: store.set("from-parent", b"hello"))
        peer.request("get", "from-parent")
        setter.join(CLIENT_TIMEOUT)
        assert peer.reply() == b"hello"
        writer = OnceBlocked(store_factory, lambda: peer.call("set", "from-peer", "hi"))
        assert store.get("from-peer") == b"hi"
        writer.join(30)

    def test_get_timeout_names_the_key(self, store: Store) -> None:
        store.set_timeout(SHORT)
        with pytest.raises(StoreTimeoutError, match="missing-key") as info:
            store.get("missing-key")
        (awaited,) = info.value.keys  # a PrefixStore names the key with its prefix
        assert awaited.endswith("missing-key")
        assert isinstance(info.value, TimeoutError)

    def test_timeout_error_reads_like_torchs(self, store: Store) -> None:
        """torch's words first (``wait timeout after 200ms, keys: ...``): code that matches
        torch's message, or catches torch's class through TorchStore, sees rdzv's too."""
        store.set_timeout(SHORT)
        for call in (lambda: store.get("late"), lambda: store.wait(["late"], SHORT)):
            with pytest.raises(StoreTimeoutError, match=r"^wait timeout after 200ms, keys: \S*late"):
                call()
        if getattr(store, "raises_torch_errors", False):
            import torch.distributed as dist

            with pytest.raises(dist.DistStoreError, match="wait timeout"):
                store.get("late")

    def test_set_timeout_and_timeout(self, store: Store) -> None:
        store.set_timeout(timedelta(seconds=12))
        assert store.timeout == timedelta(seconds=12)
        store.set_timeout(1.5)
        assert store.timeout == timedelta(seconds=1.5)
        with pytest.raises(ValueError):
            store.set_timeout(-1)

    # -- add --------------------------------------------------------------------------------
    def test_add(self, store: Store) -> None:
        assert store.add("counter", 5) == 5
        assert store.add("counter", -7) == -2
        assert store.add("counter", 0) == -2
        assert store.get("counter") == b"-2"
        store.set("preset", "40")
        assert store.add("preset", 2) == 42
        assert store.add("huge", 2**62) == 2**62

    def test_add_to_non_integer_fails_and_keeps_value(self, store: Store) -> None:
        store.set("text", "not a number")
        with pytest.raises(StoreValueError, match="text"):
            store.add("text", 1)
        assert store.get("text") == b"not a number"
        assert store.add("ok", 1) == 1

    def test_concurrent_add_from_many_peers(self, store: Store, spawn: Callable[[], Any]) -> None:
        peers, adds = [spawn() for _ in range(8)], 50
        for peer in peers:
            peer.wait_ready()
        for peer in peers:
            peer.request("add_many", "shared", 1, adds)
        results = [value for peer in peers for value in peer.reply()]
        assert sorted(results) == list(range(1, 8 * adds + 1))
        assert store.get("shared") == str(8 * adds).encode()

    # -- compare_set ------------------------------------------------------------------------
    def test_compare_set_missing_key(self, store: Store) -> None:
        assert store.compare_set("m", "expected", "desired") == b"expected"
        assert store.try_get("m") is None
        assert store.compare_set("m", "", "first") == b"first"
        assert store.get("m") == b"first"

    def test_compare_set_present_key(self, store: Store) -> None:
        store.set("p", "old")
        assert store.compare_set("p", "old", "new") == b"new"
        assert store.get("p") == b"new"
        assert store.compare_set("p", "old", "newer") == b"new"
        assert store.compare_set("p", "", "newer") == b"new"
        assert store.get("p") == b"new"
        store.set("e", b"")
        assert store.compare_set("e", b"", b"filled") == b"filled"

    def test_compare_set_one_winner(self, store: Store, spawn: Callable[[], Any]) -> None:
        peers = [spawn() for _ in range(4)]
        for peer in peers:
            peer.wait_ready()
        for number, peer in enumerate(peers):
            peer.request("compare_set", "leader", "", f"peer{number}")
        results = [peer.reply() for peer in peers]
        winner = store.get("leader")
        assert all(result == winner for result in results)
        assert winner in {f"peer{n}".encode() for n in range(4)}

    # -- multi_set_if (capability conditional) -------------------------------------------------
    def test_multi_set_if_writes_all_only_while_every_condition_holds(
        self, store: Store, client: Store
    ) -> None:
        self.require(store, "conditional")
        store.set("lock", "me")
        store.set("empty", b"")
        since = client.revision("d/")
        assert store.multi_set_if({"lock": "me", "status": None}, ["d/a", "d/b"], ["1", b"2"])
        assert client.multi_get(["d/a", "d/b"]) == [b"1", b"2"]
        assert client.watch("d/", since, SHORT) > since  # woken like any write
        refused = [
            {"lock": "other"},  # another value
            {"lock": "me", "d/a": None},  # a key that must be missing is there
            {"missing": b""},  # an empty value is not a missing key...
            {"empty": None},  # ...nor the other way round
            {"lock": "me", "missing": "x"},  # one condition of two fails
        ]
        for conditions in refused:
            assert store.multi_set_if(conditions, ["d/a", "d/c"], ["x", "y"]) is False, conditions
        assert client.multi_get(["d/a", "d/b"]) == [b"1", b"2"]
        assert client.try_get("d/c") is None
        assert store.multi_set_if({"empty": b"", "missing": None}, ["d/c"], ["z"]) is True
        assert store.multi_set_if({"lock": "me"}, [], []) is True  # a condition alone: a check
        assert client.try_get("d/c") == b"z"

    def test_multi_set_if_is_fenced_by_the_lock_of_a_closed_client(
        self, store: Store, store_factory: Any
    ) -> None:
        self.require(store, "conditional")
        self.require(store, "ephemeral")
        holder = store_factory.new_client()
        assert holder.compare_set("lock", "", "holder", ephemeral=True) == b"holder"
        assert holder.multi_set_if({"lock": "holder"}, ["decision"], ["first"])
        owner(holder).close()  # its session ends, and its lock with it
        assert store.compare_set("lock", "", "newer", ephemeral=True) == b"newer"
        assert store.multi_set_if({"lock": "holder"}, ["decision"], ["stale"]) is False
        assert store.get("decision") == b"first"

    def test_multi_set_if_has_one_winner(self, store: Store, spawn: Callable[[], Any]) -> None:
        self.require(store, "conditional")
        peers = [spawn() for _ in range(4)]
        for peer in peers:
            peer.wait_ready()
        for number, peer in enumerate(peers):
            peer.request("multi_set_if", {"slot": None}, ["slot", f"by/{number}"], ["taken", "1"])
        results = [peer.reply() for peer in peers]
        assert results.count(True) == 1 and results.count(False) == 3
        assert store.list_keys("by/") == {f"by/{results.index(True)}": b"1"}

    def test_multi_set_if_bad_arguments(self, store: Store) -> None:
        if not store.capabilities.conditional:
            with pytest.raises(StoreUnsupportedError, match="conditional"):
                store.multi_set_if({"a": "1"}, ["b"], ["2"])
            return
        with pytest.raises(StoreValueError, match="2 keys but 1 values"):
            store.multi_set_if({"a": None}, ["b", "c"], ["1"])
        with pytest.raises(StoreValueError, match="at least one condition"):
            store.multi_set_if({}, ["b"], ["1"])
        with pytest.raises(ValueError):
            store.multi_set_if({"": None}, ["b"], ["1"])
        with pytest.raises(TypeError):
            store.multi_set_if({"a": None}, ["b"], [1])  # type: ignore[list-item]
        assert store.try_get("b") is None

    def test_prefix_store_multi_set_if_prefixes_conditions_and_keys(self, store: Store) -> None:
        self.require(store, "conditional")
        view = PrefixStore("job", store)
        store.set("lock", "outside")
        assert view.multi_set_if({"lock": "outside"}, ["k"], ["v"]) is False  # job/lock
        view.set("lock", "inside")
        assert view.multi_set_if({"lock": "inside"}, ["k"], ["v"]) is True
        assert store.get("job/k") == b"v" and store.try_get("k") is None

    # -- wait / check -----------------------------------------------------------------------
    def test_wait(self, store: Store, client: Store, store_factory: Any) -> None:
        store.set("a", "1")
        store.wait(["a"])
        store.wait(["a"], timedelta(seconds=5))
        writer = OnceBlocked(store_factory, lambda: client.set("b", "2"))
        store.wait(["a", "b"], 30)
        writer.join(10)

    def test_wait_timeout(self, store: Store) -> None:
        store.set("present", "1")
        with pytest.raises(StoreTimeoutError, match="absent"):
            store.wait(["present", "absent"], SHORT)
        with pytest.raises(StoreTimeoutError, match="absent"):
            store.wait(["absent"], timedelta(seconds=SHORT))
        store.set_timeout(SHORT)
        with pytest.raises(StoreTimeoutError, match="absent"):
            store.wait(["absent"])

    def test_check(self, store: Store) -> None:
        assert store.check([])
        assert not store.check(["x"])
        store.set("x", "1")
        assert store.check(["x"])
        assert not store.check(["x", "y"])

    # -- delete_key / num_keys --------------------------------------------------------------
    def test_delete_key(self, store: Store, client: Store) -> None:
        store.set("gone", "v")
        assert store.delete_key("gone") is True
        assert store.delete_key("gone") is False
        assert client.try_get("gone") is None
        assert not client.check(["gone"])

    def test_num_keys(self, store: Store) -> None:
        before = store.num_keys()
        store.multi_set(["n1", "n2", "n3"], ["a", "b", "c"])
        store.set("n1", "again")
        assert store.num_keys() == before + 3
        store.delete_key("n2")
        assert store.num_keys() == before + 2

    # -- multi_get / multi_set / append / try_get --------------------------------------------
    def test_multi_set_multi_get(self, store: Store) -> None:
        store.multi_set(["k1", "k2", "k3"], ["v1", b"v2", "v3"])
        assert store.multi_get(["k3", "k1", "k2"]) == [b"v3", b"v1", b"v2"]
        assert store.multi_get([]) == []
        with pytest.raises(ValueError):
            store.multi_set(["a", "b"], ["only one"])

    def test_multi_get_blocks_until_all_set(
        self, store: Store, client: Store, store_factory: Any
    ) -> None:
        store.set("first", "1")
        writer = OnceBlocked(store_factory, lambda: client.set("second", "2"))
        assert store.multi_get(["first", "second"]) == [b"1", b"2"]
        writer.join(10)
        store.set_timeout(SHORT)
        with pytest.raises(StoreTimeoutError, match="third"):
            store.multi_get(["first", "third"])

    def test_append(self, store: Store) -> None:
        store.append("log", "a")
        store.append("log", b"b")
        store.append("log", "c")
        assert store.get("log") == b"abc"

    def test_try_get(self, store: Store) -> None:
        assert store.try_get("nothing") is None
        store.set("something", b"")
        assert store.try_get("something") == b""

    # -- queues (torch's queue_push / queue_pop / queue_len) -------------------------------------
    def test_queue_push_pop_len_first_in_first_out(self, store: Store, client: Store) -> None:
        assert store.queue_len("q") == 0
        store.queue_push("q", "first")
        client.queue_push("q", b"\x00second")
        store.queue_push("q", b"")
        assert client.queue_len("q") == 3
        assert client.queue_pop("q") == b"first"
        assert store.queue_pop("q", block=False) == b"\x00second"
        assert store.queue_pop("q") == b""
        assert store.queue_len("q") == 0

    def test_queue_pop_of_empty_queue_without_blocking(self, store: Store) -> None:
        with pytest.raises(QueueEmptyError, match="queue is empty") as info:
            store.queue_pop("empty", block=False)
        assert isinstance(info.value, RuntimeError)  # as torch's QueueEmptyError
        if getattr(store, "raises_torch_errors", False):
            import torch.distributed as dist

            with pytest.raises(dist.QueueEmptyError):
                store.queue_pop("empty", block=False)

    def test_queue_pop_times_out_with_the_stores_error(self, store: Store) -> None:
        store.set_timeout(SHORT)
        started = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=r"^wait timeout after 200ms, keys: \S*empty"):
            store.queue_pop("empty")
        assert time.monotonic() - started < 10 * CLIENT_TIMEOUT

    def test_queue_pop_woken_by_push_of_other_client(
        self, store: Store, client: Store, store_factory: Any
    ) -> None:
        pusher = OnceBlocked(store_factory, lambda: client.queue_push("work", "job"))
        assert store.queue_pop("work") == b"job"
        pusher.join(10)
        assert store.queue_len("work") == 0

    def test_queue_items_go_to_one_popper_each(self, store: Store, spawn: Callable[[], Any]) -> None:
        """Poppers in other processes, blocked before the pushes: every item is taken exactly
        once (a pop is atomic), and each popper is woken by pushes."""
        peers, each = [spawn() for _ in range(3)], 8
        for peer in peers:
            peer.wait_ready()
        for peer in peers:
            peer.request("pop_many", "jobs", each)
        items = [f"job-{n}".encode() for n in range(len(peers) * each)]
        for item in items:
            store.queue_push("jobs", item)
        popped = [item for peer in peers for item in peer.reply()]
        assert sorted(popped) == sorted(items)
        assert store.queue_len("jobs") == 0

    def test_queue_in_a_key_written_by_set_is_refused(self, store: Store) -> None:
        store.set("plain", "not a queue")
        for call in (lambda: store.queue_push("plain", "x"), lambda: store.queue_pop("plain"),
                     lambda: store.queue_len("plain")):
            with pytest.raises(StoreValueError, match="plain' holds a value that is not a queue"):
                call()
        assert store.get("plain") == b"not a queue"

    def test_prefix_store_queues_are_apart(self, store: Store) -> None:
        one, two = PrefixStore("one", store), PrefixStore("two", store)
        one.queue_push("q", "for one")
        assert two.queue_len("q") == 0
        assert store.queue_len("q") == 0
        assert one.queue_pop("q") == b"for one"

    # -- listing ----------------------------------------------------------------------------
    def test_list_and_count_keys(self, store: Store) -> None:
        self.require(store, "listing")
        for key in ("a/x", "a/y", "a/b/z", "ab", "b"):
            store.set(key, key.upper())
        assert store.list_keys("a/") == {"a/x": b"A/X", "a/y": b"A/Y", "a/b/z": b"A/B/Z"}
        assert store.list_keys("a/b/") == {"a/b/z": b"A/B/Z"}
        assert set(store.list_keys("a")) == {"a/x", "a/y", "a/b/z", "ab"}
        assert store.list_keys("zzz") == {}
        assert store.count_keys("a/") == 3
        assert store.count_keys("a") == 4
        assert store.count_keys("c/") == 0
        assert {"a/x", "ab", "b"} <= set(store.list_keys(""))
        store.delete_key("a/x")
        assert store.count_keys("a/") == 2
        assert set(store.list_keys("a/")) == {"a/y", "a/b/z"}

    def test_read_many_answers_like_the_single_reads(self, store: Store) -> None:
        self.require(store, "listing")
        store.set("rm/a", "1")
        store.set("rm/d/x", "x")
        store.set("rm/d/y", "y")
        reads = store.read_many(["rm/a", "rm/none"], ["rm/d/", "rm/nothing/"], ["rm/d/", "rm/never"],
                                ["rm/d/", "rm/nothing/"])
        assert reads.values == {"rm/a": b"1", "rm/none": None}
        assert reads.counts == {"rm/d/": 2, "rm/nothing/": 0}
        assert reads.revisions == {"rm/d/": store.revision("rm/d/"), "rm/never": 0}
        assert reads.revisions["rm/d/"] > 0
        assert reads.lists == {"rm/d/": {"rm/d/x": b"x", "rm/d/y": b"y"}, "rm/nothing/": {}}
        view = PrefixStore("rm", store)
        in_view = view.read_many(["a"], ["d/"], ["d/"], ["d/"])
        assert (in_view.values, in_view.counts) == ({"a": b"1"}, {"d/": 2})
        assert in_view.revisions == {"d/": reads.revisions["rm/d/"]}
        assert in_view.lists == {"d/": {"d/x": b"x", "d/y": b"y"}}
        twice = store.read_many(["rm/a", "rm/a"], ["rm/d/", "rm/d/"], ["rm/d/", "rm/d/"],
                                ["rm/d/", "rm/d/"])
        assert (twice.values, twice.counts) == ({"rm/a": b"1"}, {"rm/d/": 2}), "asked twice"
        assert (twice.revisions, twice.lists) == ({"rm/d/": reads.revisions["rm/d/"]},
                                                  {"rm/d/": reads.lists["rm/d/"]})
        empty = store.read_many()
        assert (empty.values, empty.counts, empty.revisions, empty.lists) == ({}, {}, {}, {})

    # -- revision / watch -------------------------------------------------------------------
    def test_revisions_grow_per_path(self, store: Store) -> None:
        assert store.revision("never/written") == 0
        store.set("r/k", "1")
        first = store.revision("r/k")
        assert first > 0
        store.set("r/k", "2")
        second = store.revision("r/k")
        assert second > first
        assert store.revision("r/") >= second
        assert store.revision("") >= second
        assert store.revision("r/other") == 0

    def test_watch_returns_at_once_if_changed(self, store: Store) -> None:
        store.set("w", "1")
        since = store.revision("w")
        store.set("w", "2")
        assert store.watch("w", since, 30) > since
        assert store.watch("w", 0, 30) > 0

    def test_watch_timeout_returns_old_revision(self, store: Store) -> None:
        store.set("quiet", "1")
        since = store.revision("quiet")
        assert store.watch("quiet", since, SHORT) <= since
        assert store.watch("never", 0, SHORT) == 0
        store.set_timeout(SHORT)
        assert store.watch("quiet", since) <= since

    def test_watch_woken_by_other_client(
        self, store: Store, client: Store, store_factory: Any
    ) -> None:
        since = store.revision("job/round")
        writer = OnceBlocked(store_factory, lambda: client.set("job/round", "1"))
        assert store.watch("job/round", since, 30) > since
        writer.join(10)

    def test_batch_writes_are_read_back_and_sent_by_its_end(
        self, store: Store, client: Store
    ) -> None:
        with store.batch():
            store.set("batch/a", "1")
            store.multi_set(["batch/b", "batch/c"], ["2", "3"])
            assert store.read_many(["batch/a", "batch/c"], ["batch/"]).counts == {"batch/": 3}
            store.set("batch/d", "4", ephemeral=True)
        # The last write had no request after it in the block: the block's end sent it.
        assert client.get("batch/d") == b"4"
        assert client.multi_get(["batch/a", "batch/b", "batch/c"]) == [b"1", b"2", b"3"]

    def test_watch_get_answers_with_the_key(
        self, store: Store, client: Store, store_factory: Any
    ) -> None:
        since = store.revision("wg/ctl/")
        assert store.watch_get("wg/ctl/", since, "wg/rank/0", SHORT) == (since, None)
        writer = OnceBlocked(
            store_factory, lambda: client.multi_set(["wg/rank/0", "wg/ctl/status"], [b"r0", b"sealed"])
        )
        rev, value = store.watch_get("wg/ctl/", since, "wg/rank/0", 30)
        writer.join(10)
        assert rev > since and value == b"r0"
        store.set("wg/rank/1", b"")
        assert store.watch_get("wg/ctl/", 0, "wg/rank/1", 30) == (rev, b"")

    def test_watch_woken_by_other_process(
        self, store: Store, spawn: Callable[[], Any], store_factory: Any
    ) -> None:
        peer = spawn()
        peer.wait_ready()
        since = store.revision("nodes/")
        writer = OnceBlocked(store_factory, lambda: peer.call("set", "nodes/n1", "up"))
        assert store.watch("nodes/", since, 30) > since
        writer.join(30)

    def test_watch_dir_sees_keys_under_it_and_deletes(
        self, store: Store, client: Store, store_factory: Any
    ) -> None:
        store.set("d/sub/x", "1")
        since = store.revision("d/")
        writer = OnceBlocked(store_factory, lambda: client.delete_key("d/sub/x"))
        changed = store.watch("d/", since, 30)
        writer.join(10)
        assert changed > since
        assert store.revision("d/") >= changed
        assert store.watch("d/", changed, SHORT) <= changed
        store.set("other", "1")
        assert store.watch("d/", changed, SHORT) <= changed

    # -- ephemeral keys ---------------------------------------------------------------------
    def test_ephemeral_keys_go_when_client_closes(self, store: Store, store_factory: Any) -> None:
        self.require(store, "ephemeral")
        writer = store_factory.new_client()
        writer.set("eph/set", "1", ephemeral=True)
        writer.compare_set("eph/cas", "", "2", ephemeral=True)
        writer.set("eph/kept", "3")
        assert store.check(["eph/set", "eph/cas"])
        since = store.revision("eph/")
        owner(writer).close()
        gone = lambda: not store.check(["eph/set"]) and not store.check(["eph/cas"])  # noqa: E731
        eventually(gone, EXPIRY_BOUND, "ephemeral keys deleted")
        assert store.try_get("eph/kept") == b"3"
        assert store.revision("eph/") > since

    def test_overwrite_by_other_client_keeps_key(self, store: Store, store_factory: Any) -> None:
        self.require(store, "ephemeral")
        writer = store_factory.new_client()
        writer.set("claimed", "mine", ephemeral=True)
        writer.set("writer-alive", "1", ephemeral=True)
        store.set("claimed", "yours")
        owner(writer).close()
        eventually(lambda: store.try_get("writer-alive") is None, EXPIRY_BOUND,
                   "the closed writer's ephemeral keys deleted")
        assert store.try_get("claimed") == b"yours"

    def test_ephemeral_keys_of_killed_process_vanish(self, store: Store, child: ProcessPeer) -> None:
        self.require(store, "ephemeral")
        child.call("set", "alive/killed", "1", ephemeral=True)
        child.call("set", "durable", "2")
        assert store.get("alive/killed") == b"1"
        child.kill()
        eventually(lambda: store.try_get("alive/killed") is None, EXPIRY_BOUND, "key of killed child")
        assert store.get("durable") == b"2"

    def test_ephemeral_keys_of_stopped_process_expire(
        self, store: Store, store_factory: Any, child: ProcessPeer
    ) -> None:
        self.require(store, "ephemeral")
        ttl = getattr(store_factory, "session_ttl", None)
        if ttl is None:
            pytest.skip("the factory sets no short session_ttl for its child clients")
        child.call("set", "alive/stopped", "1", ephemeral=True)
        assert store.get("alive/stopped") == b"1"
        child.stop()
        bound = 3 * ttl + EXPIRY_BOUND
        eventually(lambda: store.try_get("alive/stopped") is None, bound, "key of stopped child")

    # -- PrefixStore ------------------------------------------------------------------------
    def test_prefix_store_isolates_keys(self, store: Store) -> None:
        job_a, job_b = PrefixStore("jobA", store), PrefixStore("jobB", store)
        job_a.set("k", "a")
        job_b.set("k", "b")
        assert job_a.get("k") == b"a"
        assert job_b.get("k") == b"b"
        assert store.get("jobA/k") == b"a"
        assert job_a.add("n", 3) == 3
        assert job_b.try_get("n") is None
        assert job_a.compare_set("k", "a", "a2") == b"a2"
        assert job_a.delete_key("k") and job_b.check(["k"])
        job_b.set_timeout(SHORT)
        with pytest.raises(StoreTimeoutError):
            job_b.get("n")

    def test_prefix_store_listing_and_watch(self, store: Store) -> None:
        self.require(store, "listing")
        view = PrefixStore("pfx", store)
        store.set("outside", "x")
        view.multi_set(["d/1", "d/2"], ["1", "2"])
        assert view.list_keys("d/") == {"d/1": b"1", "d/2": b"2"}
        assert view.count_keys("") == 2
        assert view.num_keys() == 2
        since = view.revision("")
        store.set("outside", "y")
        assert view.watch("", since, SHORT) <= since
        view.append("d/1", "1")
        assert view.watch("", since, 30) > since

    # -- bad input --------------------------------------------------------------------------
    @pytest.mark.parametrize("key", [1, None, b"bytes-key"])
    def test_non_str_key_is_type_error(self, store: Store, key: Any) -> None:
        with pytest.raises(TypeError):
            store.set(key, "v")
        with pytest.raises(TypeError):
            store.try_get(key)

    def test_empty_key_is_value_error(self, store: Store) -> None:
        for call in (lambda: store.set("", "v"), lambda: store.get(""), lambda: store.add("", 1)):
            with pytest.raises(ValueError):
                call()

    @pytest.mark.parametrize("value", [1, None, 2.5, ["list"]])
    def test_non_bytes_value_is_type_error(self, store: Store, value: Any) -> None:
        with pytest.raises(TypeError):
            store.set("k", value)
        with pytest.raises(TypeError):
            store.append("k", value)
        store.set("k", "still works")
        assert store.get("k") == b"still works"

    def test_peer_error_reports_type(self, spawn: Callable[[], Any]) -> None:
        peer = spawn()
        peer.call("set", "text", "x")
        with pytest.raises(PeerError) as info:
            peer.call("add", "text", 1)
        assert info.value.type_name == "StoreValueError"
