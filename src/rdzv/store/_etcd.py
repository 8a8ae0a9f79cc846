"""EtcdStore: the Store API on an etcd v3 cluster, with watches, leases and transactions.

Keys live under ``prefix`` so that many jobs can share one etcd. Blocking reads wait on etcd
watches, ``add``/``append``/``compare_set`` are transactions on the key's ``mod_revision``,
revisions are etcd's, and ephemeral keys carry this client's lease (see
:class:`rdzv.etcd.EtcdLease`).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, ClassVar, Sequence, Union

from ..errors import (
    SessionExpiredError,
    StoreAuthenticationError,
    StoreError,
    StoreTimeoutError,
    StoreValueError,
)
from ..etcd import (
    MAX_TXN_OPS,
    EtcdAmbiguousError,
    EtcdClient,
    EtcdCompactedError,
    EtcdLease,
    EtcdOptions,
    b64,
    prefix_range_end,
    unb64,
)
from ..kv import DEFAULT_SESSION_TTL, compare_set_result, parse_counter
from ._base import (
    DEFAULT_TIMEOUT,
    Conditions,
    Reads,
    Store,
    StoreCapabilities,
    Timeout,
    Value,
    check_conditional_write,
    check_key,
    to_bytes,
    to_seconds,
)

logger = logging.getLogger(__name__)

_MAX_UPDATE_TRIES = 10_000
_MAX_CACHED_PATHS = 1024

KV = dict[str, Any]
Change = Callable[[Union[bytes, None]], "tuple[bytes, bytes | None]"]


class EtcdStore(Store):
    """A store on etcd v3 (3.4 or newer), shared by every process that names the same prefix.

    ``endpoints`` is ``"host:port,host:port"`` (or a list, or an :class:`rdzv.etcd.EtcdOptions`);
    further keyword options are those of EtcdOptions: ``protocol``, ``ssl_cert``,
    ``ssl_cert_key``, ``ca_cert``, ``user``, ``password``, ``request_timeout``,
    ``retry_timeout``. Ephemeral keys vanish ``session_ttl`` seconds after this process dies.
    """

    capabilities = StoreCapabilities(
        watch=True, ephemeral=True, listing=True, multi_process=True, conditional=True,
        atomic_writes=MAX_TXN_OPS,
    )
    client_type: ClassVar[type[EtcdClient]] = EtcdClient
    """The class of :attr:`client` (a backend may send its requests its own way)."""

    def __init__(
        self,
        endpoints: Union[str, Sequence[str], EtcdOptions],
        *,
        prefix: str = "",
        timeout: Timeout = DEFAULT_TIMEOUT,
        session_ttl: float = DEFAULT_SESSION_TTL,
        **options: Any,
    ) -> None:
        super().__init__(timeout)
        if isinstance(endpoints, EtcdOptions):
            if options:
                raise TypeError("pass etcd options either in EtcdOptions or as keywords, not both")
            self.options = endpoints
        else:
            self.options = EtcdOptions.from_config(endpoints, options, strict=True)
        if not isinstance(prefix, str):
            raise TypeError(f"the key prefix must be str, not {type(prefix).__name__}")
        self.prefix = prefix
        self._head = prefix.encode()
        self.client = self.client_type(self.options)
        """The etcd client (for backends that build their own transactions)."""
        self.session = EtcdLease(self.client, session_ttl)
        """This client's lease: what ephemeral keys are attached to."""
        self._closed = False
        self._deletes: dict[str, tuple[int, int]] = {}
        """Per path: (history scanned up to this revision, last deletion seen)."""
        self._deletes_lock = threading.Lock()
        try:
            self.client.call("kv/range", {**self._range(""), "count_only": True})
        except BaseException:
            self.client.close()
            raise

    # -- key encoding -------------------------------------------------------------------------
    def etcd_key(self, key: str) -> bytes:
        """The etcd key (bytes, with the prefix) that holds store key ``key``."""
        return self._head + check_key(key).encode()

    def _range(self, path: str) -> dict[str, str]:
        """The etcd range of a path: an exact key, a ``dir/`` or ``""`` (the whole prefix)."""
        if path and not path.endswith("/"):
            return {"key": b64(self.etcd_key(path))}
        return self._prefix_range(path)

    def _prefix_range(self, prefix: str) -> dict[str, str]:
        """The etcd range of every key starting with ``prefix`` (under the store's prefix)."""
        start = self._head + prefix.encode()
        return {"key": b64(start or b"\0"), "range_end": b64(prefix_range_end(start))}

    # -- reads --------------------------------------------------------------------------------
    def _get_kv(self, key: bytes) -> KV | None:
        kvs = self.client.call("kv/range", {"key": b64(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _read(self, keys: list[str], count_only: bool = False) -> tuple[list[KV | None], int]:
        """The current kv of each key (None if missing) and a revision they were all read at
        or after (the earliest, when etcd's limit per transaction splits the read)."""
        found: list[KV | None] = []
        revisions = [0]
        for start in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[start : start + MAX_TXN_OPS]
            ops = [{"request_range": {"key": b64(self.etcd_key(k)), "count_only": count_only}}
                   for k in chunk]  # fmt: skip
            answer = self.client.call("kv/txn", {"success": ops})
            revisions.append(int(answer["header"]["revision"]))
            for response in answer.get("responses", []):
                result = response["response_range"]
                if count_only:
                    found.append(result if int(result.get("count", 0)) else None)
                else:
                    found.append(result["kvs"][0] if result.get("kvs") else None)
        return found, min(revisions[1:], default=0)

    def try_get(self, key: str) -> bytes | None:
        kv = self._get_kv(self.etcd_key(key))
        return None if kv is None else unb64(kv.get("value"))

    def check(self, keys: Sequence[str]) -> bool:
        found, _ = self._read([check_key(k) for k in keys], count_only=True)
        return all(kv is not None for kv in found)

    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        deadline = time.monotonic() + timeout
        while True:
            found, revision = self._read(keys)
            missing = [k for k, kv in zip(keys, found) if kv is None]
            if not missing:
                return [unb64(kv.get("value")) for kv in found if kv is not None]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError.waiting_for(missing, timeout)
            create = {"key": b64(self.etcd_key(missing[0])), "start_revision": revision + 1,
                      "filters": ["NODELETE"]}  # fmt: skip
            try:
                self.client.watch(create, timeout=remaining)
            except EtcdCompactedError:
                continue

    def num_keys(self) -> int:
        """The number of keys under this store's prefix."""
        return self.count_keys("")

    def list_keys(self, prefix: str) -> dict[str, bytes]:
        return self._items(self.client.call("kv/range", self._prefix_range(prefix)).get("kvs", []))

    def _items(self, kvs: list[KV]) -> dict[str, bytes]:
        """Store key -> value of etcd's ``kvs`` (the store's prefix cut off)."""
        cut = len(self._head)
        return {unb64(kv["key"])[cut:].decode(): unb64(kv.get("value")) for kv in kvs}

    def count_keys(self, prefix: str) -> int:
        answer = self.client.call("kv/range", {**self._prefix_range(prefix), "count_only": True})
        return int(answer.get("count", 0))

    def revision(self, path: str = "") -> int:
        """The etcd revision of the last change (put or delete) of ``path``.

        The newest ``mod_revision`` under the path, or a later deletion: those are found in
        etcd's history since that revision (scanned once per path and process, then only what
        is new). Without the right to watch the whole keyspace, or past a compaction, the result
        may be later than the real last change (never earlier), which is still a correct
        ``since`` for :meth:`watch`.
        """
        answer = self.client.call("kv/range", self._revision_read(path))
        return self._revision_from(path, answer, int(answer["header"]["revision"]))

    def _revision_read(self, path: str) -> dict[str, Any]:
        """The range request whose answer :meth:`_revision_from` needs."""
        body = {**self._range(path), "limit": 1, "keys_only": True}
        if "range_end" in body:
            body.update(sort_order="DESCEND", sort_target="MOD")
        return body

    def _revision_from(self, path: str, answer: dict[str, Any], current: int) -> int:
        """``revision(path)`` from the answer to :meth:`_revision_read`, read at ``current``."""
        kvs = answer.get("kvs")
        newest = int(kvs[0]["mod_revision"]) if kvs else 0
        if newest >= current:
            return newest
        return max(newest, self._last_delete(path, newest, current))

    def read_many(
        self,
        keys: Sequence[str] = (),
        counts: Sequence[str] = (),
        revisions: Sequence[str] = (),
        lists: Sequence[str] = (),
    ) -> Reads:
        """All reads in one etcd transaction, so they come from one revision (several
        transactions, each consistent, past etcd's limit of operations per transaction; the
        revisions first)."""
        asked: list[tuple[str, str, dict[str, Any]]] = (
            [("revision", p, self._revision_read(p)) for p in revisions]
            + [("value", k, {"key": b64(self.etcd_key(k))}) for k in keys]
            + [("count", p, {**self._prefix_range(p), "count_only": True}) for p in counts]
            + [("list", p, self._prefix_range(p)) for p in lists]
        )
        reads = Reads({}, {}, {}, {})
        for start in range(0, len(asked), MAX_TXN_OPS):
            chunk = asked[start : start + MAX_TXN_OPS]
            answer = self.client.call(
                "kv/txn", {"success": [{"request_range": op} for _, _, op in chunk]}
            )
            current = int(answer["header"]["revision"])
            for (kind, name, _), response in zip(chunk, answer.get("responses", [])):
                result = response["response_range"]
                if kind == "value":
                    kvs = result.get("kvs")
                    reads.values[name] = unb64(kvs[0].get("value")) if kvs else None
                elif kind == "count":
                    reads.counts[name] = int(result.get("count", 0))
                elif kind == "list":
                    reads.lists[name] = self._items(result.get("kvs", []))
                else:
                    reads.revisions[name] = self._revision_from(name, result, current)
        return reads

    def _last_delete(self, path: str, newest: int, current: int) -> int:
        """The revision of the last deletion under ``path`` up to ``current`` (0 if none)."""
        with self._deletes_lock:
            scanned, last = self._deletes.get(path, (0, 0))
        start = max(newest, scanned) + 1
        if start > current:
            return last
        selected = self._range(path)
        low = unb64(selected["key"])
        high = unb64(selected["range_end"]) if "range_end" in selected else None
        try:
            events = self.client.history(start, current)
        except EtcdCompactedError as exc:
            logger.info("etcd history before revision %d is compacted", exc.compact_revision)
            return max(last, exc.compact_revision, newest)
        except StoreAuthenticationError as exc:
            logger.warning("cannot read etcd's history (%s): revision() is an upper bound", exc)
            return current
        for event in events:
            if event.get("type") == "DELETE":
                key = unb64(event["kv"]["key"])
                if (key == low) if high is None else (low <= key and (high == b"\0" or key < high)):
                    last = max(last, int(event["kv"]["mod_revision"]))
        with self._deletes_lock:
            if len(self._deletes) >= _MAX_CACHED_PATHS:
                self._deletes.clear()
            self._deletes[path] = (current, last)
        return last

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        seconds = to_seconds(timeout, self._timeout)
        create = {**self._range(path), "start_revision": int(since) + 1}
        try:
            events = self.client.watch(create, timeout=seconds)
        except EtcdCompactedError:
            # The history since `since` is gone: report a change so the caller re-reads.
            answer = self.client.call("kv/range", {**self._range(path), "count_only": True})
            return max(int(since) + 1, int(answer["header"]["revision"]))
        if not events:
            return int(since)
        return max(int(event["kv"]["mod_revision"]) for event in events)

    # -- writes -------------------------------------------------------------------------------
    def _put(self, key: bytes, value: bytes, lease: str | None) -> dict[str, str]:
        put = {"key": b64(key), "value": b64(value)}
        if lease is not None:
            put["lease"] = lease
        return put

    def _lease(self, ephemeral: bool) -> str | None:
        return self.session.id() if ephemeral else None

    def _write(
        self, path: str, body: dict[str, Any], lease: str | None, **kwargs: Any
    ) -> dict[str, Any]:
        try:
            return self.client.call(path, body, **kwargs)
        except SessionExpiredError as exc:
            if lease is not None:
                self.session.lost(lease, str(exc), reported=True)
            raise

    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        data = to_bytes(value)
        lease = self._lease(ephemeral)
        self._write("kv/put", self._put(self.etcd_key(key), data, lease), lease)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise StoreValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        latest = {self.etcd_key(k): to_bytes(v) for k, v in zip(keys, values)}  # last one wins
        items = list(latest.items())
        for start in range(0, len(items), MAX_TXN_OPS):
            ops = [
                {"request_put": self._put(k, v, None)}
                for k, v in items[start : start + MAX_TXN_OPS]
            ]
            self.client.call("kv/txn", {"success": ops})

    def multi_set_if(
        self, conditions: Conditions, keys: Sequence[str], values: Sequence[Value]
    ) -> bool:
        """One transaction comparing every condition (a missing key: create revision 0).
        More than ``MAX_TXN_OPS`` keys go in several transactions, in order, each with the
        conditions: one that fails ends the write (the earlier ones stay), so a caller puts
        the key that commits its decision last."""
        checked, names, data = check_conditional_write(conditions, keys, values)
        compare = [
            {"key": b64(self.etcd_key(k)), "target": "VALUE", "result": "EQUAL", "value": b64(v)}
            if v is not None else
            {"key": b64(self.etcd_key(k)), "target": "CREATE", "result": "EQUAL",
             "create_revision": "0"}
            for k, v in checked.items()
        ]  # fmt: skip
        items = list({self.etcd_key(k): v for k, v in zip(names, data)}.items())
        for start in range(0, max(len(items), 1), MAX_TXN_OPS):
            ops = [{"request_put": self._put(k, v, None)}
                   for k, v in items[start : start + MAX_TXN_OPS]]  # fmt: skip
            if not self.client.call("kv/txn", {"compare": compare, "success": ops}).get(
                "succeeded"
            ):
                return False
        return True

    def delete_key(self, key: str) -> bool:
        answer = self.client.call("kv/deleterange", {"key": b64(self.etcd_key(key))})
        return int(answer.get("deleted", 0)) > 0

    def add(self, key: str, amount: int) -> int:
        amount = int(amount)

        def change(current: bytes | None) -> tuple[bytes, bytes | None]:
            new = str(parse_counter(key, current) + amount).encode()
            return new, new

        return int(self._update(key, change, keep_lease=True))

    def append(self, key: str, value: Value) -> None:
        data = to_bytes(value)
        self._update(key, lambda current: ((current or b"") + data,) * 2, keep_lease=True)

    def compare_set(
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        exp, des = to_bytes(expected), to_bytes(desired)
        lease = self._lease(ephemeral)
        if not exp:  # a missing key and an empty value both match: needs the general update
            return self._update(
                key, lambda current: _compare_set(current, exp, des), keep_lease=False, lease=lease
            )
        k = self.etcd_key(key)
        body = {
            "compare": [{"key": b64(k), "target": "VALUE", "result": "EQUAL", "value": b64(exp)}],
            "success": [{"request_put": self._put(k, des, lease)}],
            "failure": [{"request_range": {"key": b64(k)}}],
        }
        answer = self._write("kv/txn", body, lease)
        if answer.get("succeeded"):
            return des
        kvs = answer["responses"][0]["response_range"].get("kvs")
        return unb64(kvs[0].get("value")) if kvs else exp

    def _update(
        self, key: str, change: Change, *, keep_lease: bool, lease: str | None = None
    ) -> bytes:
        """Read-modify-write ``key`` as a transaction on its mod_revision, retried on conflict.

        ``change(current)`` returns ``(result, value to write or None)``. The new value keeps
        the key's lease if ``keep_lease``, else gets ``lease``. The first try assumes the key
        is missing (when that would write) instead of reading it: a key written for the first
        time costs one request, and a wrong guess answers with the key as a read would.
        """
        k = self.etcd_key(key)
        kv = None if change(None)[1] is not None else self._get_kv(k)
        deadline = time.monotonic() + self._timeout
        for _ in range(_MAX_UPDATE_TRIES):
            result, new = change(None if kv is None else unb64(kv.get("value")))
            if new is None:
                return result
            mod = int(kv["mod_revision"]) if kv else 0
            put_lease = (kv.get("lease") if kv else None) if keep_lease else lease
            body = {
                "compare": [
                    {"key": b64(k), "target": "MOD", "result": "EQUAL", "mod_revision": mod}
                ],
                "success": [{"request_put": self._put(k, new, put_lease)}],
                "failure": [{"request_range": {"key": b64(k)}}],
            }
            try:
                answer = self._write("kv/txn", body, put_lease, retry_ambiguous=False)
            except EtcdAmbiguousError:
                kv = self._get_kv(k)
                if (
                    kv is not None
                    and int(kv["mod_revision"]) != mod
                    and unb64(kv.get("value")) == new
                ):
                    return result  # our write went through before the answer was lost
                continue
            except SessionExpiredError:
                if not keep_lease:
                    raise
                kv = self._get_kv(k)  # the key's owner expired meanwhile: start over
                continue
            if answer.get("succeeded"):
                return result
            kvs = answer["responses"][0]["response_range"].get("kvs")
            kv = kvs[0] if kvs else None
            if time.monotonic() > deadline:
                break
        raise StoreError(
            f"could not update key {key!r}: other clients kept changing it for "
            f"{timedelta(seconds=self._timeout)}"
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Revoke this client's lease (deleting its ephemeral keys) and close the connections."""
        if self._closed:
            return
        self._closed = True
        self.session.revoke()
        self.client.close()


def _compare_set(
    current: bytes | None, expected: bytes, desired: bytes
) -> tuple[bytes, bytes | None]:
    result, write = compare_set_result(current, expected, desired)
    return result, desired if write else None
