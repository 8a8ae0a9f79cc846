"""TCPStore: a client of the rdzv store server, with torch's ``TCPStore`` constructor.

One TCP connection per store object (``TCP_NODELAY``, blocking socket, one lock: thread safe),
one round trip per call, except for the void writes ``set`` and ``multi_set``: like torch's
``TCPStore.set`` they return once the request is sent (*pipelined*). Their acknowledgements are
collected, in order, by the next call that waits for an answer (any read or returning write), by
:meth:`TCPStore.flush`, or by ``close()``; a pipelined write that failed is raised by that next
call, naming the write. At most ``MAX_UNACKED_WRITES`` (or ``MAX_UNACKED_BYTES``) stay
unacknowledged; beyond that a write waits for the earlier acknowledgements.

:class:`TCPStore` encodes each call's request (:mod:`rdzv.kv.protocol`) and has its
:class:`~._tcp_conn.StoreConnection` send it and read the answer; the blocking reads wait on the
server in slices (:mod:`._tcp_blocking`); a master store also holds its embedded server.

The connection carries a *session*: keys set with ``ephemeral=True`` live as long as it. A
keepalive thread pings an idle connection every ``session_ttl / 3`` seconds, and blocking calls
wait on the server in chunks of at most that long, so a live client never looks dead; a client
that is killed, hung or cut off loses its ephemeral keys.

A lost connection is re-established (with backoff, within the call's timeout) and the session
resumed, so a client carries on across a restart of a durable server. Every unacknowledged write
is resent after a reconnect, in order; the server applies none twice (it remembers the last write
request id of each session and answers a resent one without applying it). If the session expired
meanwhile, only reads and conditional writes are sent again; the other unconfirmed writes are
dropped and named by the SessionExpiredError that reports the expiry (docs/protocol.md,
"Session expiry").
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import time
import weakref
from dataclasses import replace
from typing import Callable, Iterator, Sequence

from .._clock import SYSTEM_CLOCK, Clock
from ..errors import StoreProtocolError, StoreTimeoutError, StoreUnsupportedError, StoreValueError
from ..kv import DEFAULT_SESSION_TTL, auth, protocol as P
from . import _tcp_blocking as blocking
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
)
from ._embedded import check_arguments, start_server, stop_server
from ._tcp_conn import StoreConnection, log
from ._tcp_pipeline import MAX_UNACKED_BYTES, MAX_UNACKED_WRITES

__all__ = ["INIT_KEY", "MAX_UNACKED_BYTES", "MAX_UNACKED_WRITES", "TCPStore"]

INIT_KEY = "init/"
"""The counter that clients increment when created with a world size (as torch's do)."""
_OK = P.STATUS_OK
_encode_set = P.encode_set
_encode_get = P.encode_get
_TIMEOUT = P.STATUS_TIMEOUT
_monotonic = time.monotonic


_READ_ENCODERS: dict[int, Callable[[int, bytes], bytes]] = {
    P.OP_GET: lambda rid, key: P.encode_get(rid, key, False),
    P.OP_COUNT_KEYS: P.encode_count_keys,
    P.OP_REVISION: P.encode_revision,
    P.OP_LIST_KEYS: P.encode_list_keys,
}
"""The encoder of each request kind of :meth:`TCPStore.read_many`."""


def _found(payload: bytes) -> bytes | None:
    """The value in the answer to a non-blocking get (a found byte, then the value)."""
    if not payload:
        raise StoreProtocolError("malformed try_get response")
    return payload[1:] if payload[0] else None


def _bind_host(host_name: str) -> str:
    """Where an embedded server listens: loopback names as given, else every interface."""
    if host_name in ("localhost", "::1") or host_name.startswith("127."):
        return host_name
    return "::" if ":" in host_name else "0.0.0.0"


class TCPStore(Store):
    """A store served by an rdzv store server (``rdzv serve``, or embedded with ``is_master``).

    The arguments are torch's: ``is_master=True`` starts a :class:`~rdzv.server.StoreServer` in
    this process (port 0 picks a free port; :attr:`port` tells it), and with ``world_size`` (and
    ``wait_for_workers``) every client counts itself in and the master waits for all of them.
    With ``multi_tenant=True`` the masters of one port in a process share one server (as
    torch's; see :mod:`._embedded`); ``use_libuv`` is accepted and ignored;
    ``master_listen_fd`` is a listening socket the embedded server takes over. Malformed
    arguments (world size 0, a port outside 0-65535, a malformed host name) fail at once.

    ``secret`` (default: ``$RDZV_STORE_SECRET``) authenticates this client to the server and the
    server to it. ``session_ttl`` is how long the server keeps this client's ephemeral keys after
    it stops hearing from it (0: only until the connection closes); the client pings it when
    idle for a third of that by ``clock`` (:mod:`rdzv._clock`; tests move it by hand).
    """

    capabilities = StoreCapabilities(
        watch=True, ephemeral=True, listing=True, multi_process=True, conditional=True
    )

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        secret: auth.Secret = None,
        session_ttl: float = DEFAULT_SESSION_TTL,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        super().__init__(timeout)
        host_name, port, world_size = check_arguments(
            host_name, port, world_size, is_master, master_listen_fd
        )
        session_ttl = float(session_ttl)
        if not session_ttl >= 0:
            raise ValueError(f"session_ttl must be >= 0, got {session_ttl}")
        shared = auth.normalize_secret(secret) if secret is not None else auth.secret_from_env()
        self._server = None
        self._finalizer: weakref.finalize | None = None
        if is_master:
            server = start_server(_bind_host(host_name), port, shared, master_listen_fd, multi_tenant)
            self._server = server
            port = server.port
            self._finalizer = weakref.finalize(self, stop_server, server)
        self._conn = StoreConnection(host_name, port, shared, session_ttl, self._timeout, clock)
        self._slice_ms = P.wait_ms(self._conn.ping_every)
        """A whole server-side wait of a blocking read (see :mod:`._tcp_blocking`)."""
        self._server_lacks_watch_get = False
        try:
            deadline = _monotonic() + self._timeout
            self._conn.open(deadline)
            if world_size is not None and wait_for_workers:
                self.add(INIT_KEY, 1)
                if is_master:
                    self._wait_for_workers(world_size, deadline)
        except BaseException:
            self.close()
            raise

    # -- torch's attributes -------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self._conn.host

    @property
    def port(self) -> int:
        return self._conn.port

    @property
    def session_id(self) -> int:
        """The server's id of this client's session (0 before the first connection)."""
        return self._conn.session

    @property
    def server(self):  # type: ignore[no-untyped-def]
        """The embedded :class:`~rdzv.server.StoreServer` of a master store, else None."""
        return self._server

    def __repr__(self) -> str:
        return f"TCPStore({self._conn.addr}, session {self._conn.session})"

    def set_timeout(self, timeout: Timeout) -> None:
        super().set_timeout(timeout)
        self._conn.timeout = self._timeout

    # -- writes ---------------------------------------------------------------------------------
    def set(self, key: str, value: Value, *, ephemeral: bool = False) -> None:
        if key.__class__ is not str or not key:
            check_key(key)
        vb = value if value.__class__ is bytes else to_bytes(value)
        self._conn.send_write(
            _encode_set, (key.encode(), vb, ephemeral, True), "set", key, ephemeral=ephemeral
        )

    def add(self, key: str, amount: int) -> int:
        kb = check_key(key).encode()
        conn = self._conn
        try:
            status, payload = conn.request(P.encode_add, (kb, int(amount)))
        except struct.error:
            raise StoreValueError(f"add({key!r}, {amount}): the amount is not a 64-bit integer") from None
        if status:
            raise conn.error(status, payload, "add", key)
        return int(payload)

    def compare_set(
        self, key: str, expected: Value, desired: Value, *, ephemeral: bool = False
    ) -> bytes:
        kb = check_key(key).encode()
        exp, des = to_bytes(expected), to_bytes(desired)
        conn = self._conn
        status, payload = conn.request(
            P.encode_compare_set, (kb, exp, des, ephemeral), ephemeral=ephemeral
        )
        if status:
            raise conn.error(status, payload, "compare_set", key)
        return payload

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        kbs = [check_key(k).encode() for k in keys]
        vbs = [to_bytes(v) for v in values]
        if len(kbs) != len(vbs):
            raise StoreValueError(f"multi_set got {len(kbs)} keys but {len(vbs)} values")
        if not kbs:
            return
        self._conn.send_write(P.encode_multi_set, (kbs, vbs), "multi_set", keys[0])

    def multi_set_if(
        self, conditions: Conditions, keys: Sequence[str], values: Sequence[Value]
    ) -> bool:
        """One request (MULTI_SET_IF), answered once applied (or refused) by the server. A
        server that predates it makes this raise StoreUnsupportedError, and this client's
        :attr:`capabilities` then say ``conditional=False``."""
        checked, names, data = check_conditional_write(conditions, keys, values)
        if not self.capabilities.conditional:
            raise self._lacks_multi_set_if()
        conds = [(k.encode(), v) for k, v in checked.items()]
        kbs = [k.encode() for k in names]
        first = next(iter(checked))
        try:
            return P.decode_bool(
                self._conn.call(P.encode_multi_set_if, (conds, kbs, data), "multi_set_if", first)
            )
        except StoreProtocolError as exc:
            if exc.code != P.E_UNKNOWN_OP:
                raise
        self.capabilities = replace(self.capabilities, conditional=False)  # type: ignore[misc]
        raise self._lacks_multi_set_if()

    def _lacks_multi_set_if(self) -> StoreUnsupportedError:
        return StoreUnsupportedError(
            f"the store server at {self._conn.addr} predates conditional writes "
            "(multi_set_if): upgrade it to this rdzv version (rdzv serve)"
        )

    def append(self, key: str, value: Value) -> None:
        kb = check_key(key).encode()
        vb = to_bytes(value)
        self._conn.call(P.encode_append, (kb, vb), "append", key)

    def delete_key(self, key: str) -> bool:
        kb = check_key(key).encode()
        return P.decode_bool(self._conn.call(P.encode_delete, (kb,), "delete_key", key))

    # -- reads ------------------------------------------------------------------------------------
    def try_get(self, key: str) -> bytes | None:
        kb = check_key(key).encode()
        return _found(self._conn.call(_encode_get, (kb, False), "try_get", key))

    def check(self, keys: Sequence[str]) -> bool:
        kbs = [check_key(k).encode() for k in keys]
        if not kbs:
            return True
        return P.decode_bool(self._conn.call(P.encode_check, (kbs,), "check"))

    def num_keys(self) -> int:
        return P.decode_u64(self._conn.call(P.encode_num_keys, (), "num_keys"))

    def list_keys(self, prefix: str) -> dict[str, bytes]:
        return P.decode_items(self._conn.call(P.encode_list_keys, (prefix.encode(),), "list_keys"))

    def count_keys(self, prefix: str) -> int:
        return P.decode_u64(self._conn.call(P.encode_count_keys, (prefix.encode(),), "count_keys"))

    def revision(self, path: str = "") -> int:
        return P.decode_u64(self._conn.call(P.encode_revision, (path.encode(),), "revision"))

    def read_many(
        self,
        keys: Sequence[str] = (),
        counts: Sequence[str] = (),
        revisions: Sequence[str] = (),
        lists: Sequence[str] = (),
    ) -> Reads:
        """Several non-blocking reads in one round trip: the requests are sent together
        (pipelined) and answered in order, the revisions first."""
        asked = [
            *((P.OP_REVISION, p.encode(), "revision", p) for p in revisions),
            *((P.OP_GET, check_key(k).encode(), "try_get", k) for k in keys),
            *((P.OP_COUNT_KEYS, p.encode(), "count_keys", p) for p in counts),
            *((P.OP_LIST_KEYS, p.encode(), "list_keys", p) for p in lists),
        ]
        if not asked:
            return Reads({}, {}, {}, {})
        conn = self._conn
        answers = conn.exchange_many([(_READ_ENCODERS[op], arg) for op, arg, _, _ in asked])
        for (status, payload), (_, _, what, name) in zip(answers, asked):
            if status:
                raise conn.error(status, payload, what, name)
        ends = list(itertools.accumulate((len(revisions), len(keys), len(counts))))
        return Reads(
            {k: _found(payload) for k, (_, payload) in zip(keys, answers[ends[0] :])},
            {p: P.decode_u64(payload) for p, (_, payload) in zip(counts, answers[ends[1] :])},
            {p: P.decode_u64(payload) for p, (_, payload) in zip(revisions, answers)},
            {p: P.decode_items(payload) for p, (_, payload) in zip(lists, answers[ends[2] :])},
        )

    # -- blocking reads (waits on the server: :mod:`._tcp_blocking`) ------------------------------
    def get(self, key: str) -> bytes:
        if key.__class__ is not str or not key:
            check_key(key)
        conn = self._conn
        timeout = self._timeout
        if timeout < conn.ping_every:
            return blocking.get(conn, key, timeout)
        # Fast path: the first (often the only) server-side wait is a whole slice.
        started = _monotonic()
        status, payload = conn.request(
            _encode_get, (key.encode(), True, self._slice_ms), started + timeout
        )
        if status == _OK:
            return payload
        if status != _TIMEOUT:
            raise conn.error(status, payload, "get", key)
        if _monotonic() >= started + timeout:
            raise StoreTimeoutError.waiting_for([key], timeout)
        return blocking.get(conn, key, timeout, started + timeout)

    def _get_blocking(self, keys: list[str], timeout: float) -> list[bytes]:
        return blocking.multi_get(self._conn, keys, timeout)

    def _wait(self, keys: list[str], timeout: float) -> None:
        blocking.wait(self._conn, keys, timeout)

    def watch(self, path: str, since: int, timeout: Timeout = None) -> int:
        pb, since = path.encode(), int(since)
        encode = lambda rid, wait: P.encode_watch(rid, pb, since, wait)  # noqa: E731
        return P.decode_u64(blocking.watch(self._conn, encode, "watch", path, since, timeout))

    def watch_get(
        self, path: str, since: int, key: str, timeout: Timeout = None
    ) -> tuple[int, bytes | None]:
        if not self._server_lacks_watch_get:
            pb, kb, since = path.encode(), check_key(key).encode(), int(since)
            encode = lambda rid, wait: P.encode_watch_get(rid, pb, since, wait, kb)  # noqa: E731
            try:
                return P.decode_watch_get(
                    blocking.watch(self._conn, encode, "watch_get", path, since, timeout)
                )
            except StoreProtocolError as exc:
                if exc.code != P.E_UNKNOWN_OP:
                    raise
            log.info("the store server at %s predates watch_get: watch, then get", self._conn.addr)
            self._server_lacks_watch_get = True
        return super().watch_get(path, since, key, timeout)

    # -- batches, flush, close ------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Writes this thread makes inside go out with the next request, in one message with it
        (at the latest when the block ends), instead of one message each. One thread at a time:
        in another thread's block, writes are sent at once."""
        mine = self._conn.begin_batch()
        try:
            yield
        finally:
            if mine:
                self._conn.end_batch()

    def ping(self) -> None:
        """One round trip to the server (reconnecting if needed)."""
        self._conn.call(P.encode_ping, (), "ping")

    def flush(self) -> None:
        """Wait until the server has acknowledged every earlier write of this client.

        ``set`` and ``multi_set`` return once their request is sent (as torch's ``set``); after
        ``flush()`` they are applied (and, on a server with a data dir, durable) and visible to
        every other client. Raises the error of a write that failed. Any call that returns an
        answer from the server (a read, ``add``, ``compare_set``...) implies the same.
        """
        self._conn.flush()

    def close(self) -> None:
        """End this client's session (its ephemeral keys go at once) and close the connection.

        Pipelined writes not yet acknowledged are confirmed first (reconnecting for at most
        5 s); if that fails it is logged, not raised (call :meth:`flush` to know). A master
        store also stops its embedded server.
        """
        self._conn.close()
        if self._finalizer is not None:
            self._finalizer()

    def _wait_for_workers(self, world_size: int, deadline: float) -> None:
        while True:
            rev = self.revision(INIT_KEY)
            joined = int(self.try_get(INIT_KEY) or b"0")
            if joined >= world_size:
                return
            remaining = deadline - _monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(
                    f"Timed out after {self._timeout:g} seconds waiting for clients. "
                    f"{joined}/{world_size} clients joined. (the store at {self._conn.addr}: "
                    f"start the other {world_size - joined}, or raise the timeout)",
                    (INIT_KEY,),
                )
            self.watch(INIT_KEY, rev, remaining)
