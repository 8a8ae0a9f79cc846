"""StoreServer: the store served over TCP by the server's own epoll event loop (:mod:`._loop`).

One thread runs the loop; the data lives in a :class:`~rdzv.kv.KVState`. Every request
is answered from memory without blocking the loop. Blocking reads (get, wait, multi_get) and
watches that cannot be answered at once become *waiters*, registered under the paths they care
about and answered the moment a write touches one of them (or when their wait runs out).

Each connection carries a *session*: a client's ephemeral keys live as long as it. A session
ends when its connection closes, when no frame arrives on it for its ttl, or when the client says
so (``close_session``). With ``data_dir`` every change is written ahead to a log before any
response that depends on it is sent.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import threading
from typing import Any

from .._address import check_host, check_port, port_taken
from ..errors import StoreError
from ..kv import KVState, auth, protocol as P
from ._budget import DEFAULT_MEMORY_BUDGET, resident_bytes, return_freed_memory
from ._core import Core
from ._loop import EPOLLIN, EventLoop
from ._metrics import ServerMetricsSnapshot

log = logging.getLogger("rdzv.server")
LISTEN_BACKLOG = 4096
_ACCEPTS_PER_EVENT = 64
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (thousands of clients); the new soft limit."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    except (ValueError, OSError) as exc:
        log.debug("could not raise RLIMIT_NOFILE from %s to %s: %s", soft, target, exc)
        return soft


def _listen_socket(host: str | None, port: int) -> socket.socket:
    """A bound socket for ``host:port`` (one address only, so that port 0 means one port)."""
    bind_host = host or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(bind_host, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {bind_host}:{port}: {exc}") from None
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and bind_host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        hint = port_taken(port) if exc.errno == errno.EADDRINUSE else ""
        raise OSError(exc.errno, f"cannot listen on {bind_host}:{port}: {exc.strerror}{hint}"
                      ) from None
    return sock


class _Listener:
    """The listening socket on the loop: accepts connections and hands them to the core."""

    def __init__(self, core: Core, sock: socket.socket) -> None:
        self.core = core
        self.sock = sock
        sock.setblocking(False)
        sock.listen(LISTEN_BACKLOG)
        core.loop.register(sock.fileno(), EPOLLIN, self)

    def on_event(self, events: int) -> None:
        for _ in range(_ACCEPTS_PER_EVENT):
            try:
                sock, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    log.error(
                        "cannot accept connections (%s); pausing for a second (raise the "
                        "open files limit, ulimit -n, for more clients)", exc.strerror
                    )
                    self.core.loop.unregister(self.sock.fileno())
                    self.core.loop.call_later(1.0, self._resume)
                else:
                    log.warning("accepting a connection failed: %s", exc)
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            self.core.accept(sock, peer)

    def _resume(self) -> None:
        if not self.core.stopping and self.sock.fileno() >= 0:
            self.core.loop.register(self.sock.fileno(), EPOLLIN, self)

    def close(self) -> None:
        self.core.loop.unregister(self.sock.fileno())
        self.sock.close()


class StoreServer:
    """The rdzv store served over TCP.

    ``StoreServer(host, port).start()`` serves from a background thread of this process and
    returns once listening (port 0 picks a free port: see :attr:`port`); ``serve_forever()``
    serves in the calling thread until SIGINT/SIGTERM or :meth:`stop`. With ``data_dir`` every
    acknowledged write survives a crash of the server (``fsync="always"``) or of its process
    (``fsync="never"``). ``memory_budget`` bounds the bytes buffered for all clients together
    (requests not yet read whole, answers not yet taken); beyond it the connections holding the
    most are dropped with an error. With ``budget_covers_process`` (``rdzv serve``: the process
    is the server's alone) the budget also covers the process's memory when it started serving.
    """

    def __init__(
        self,
        host: str | None = "127.0.0.1",
        port: int = 0,
        *,
        secret: auth.Secret = None,
        data_dir: str | os.PathLike | None = None,
        fsync: str = "always",
        max_frame_size: int = P.DEFAULT_MAX_FRAME_SIZE,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        budget_covers_process: bool = False,
        sock: socket.socket | None = None,
    ) -> None:
        if host:  # (None or "": every interface)
            check_host(host, "store server host")
        check_port(port, "store server port")
        if fsync not in ("always", "never"):
            raise ValueError(f"fsync must be 'always' or 'never', not {fsync!r}")
        if not 1024 <= max_frame_size <= 0xFFFFFFFF:
            raise ValueError(f"max_frame_size must be between 1 KiB and 4 GiB, not {max_frame_size}")
        self.host = host
        self._port = port
        self._secret = auth.normalize_secret(secret)
        self._data_dir = data_dir
        self._fsync = fsync
        self._max_frame_size = max_frame_size
        self._memory_budget = memory_budget
        self._budget_covers_process = budget_covers_process
        self._sock = sock
        self._loop: EventLoop | None = None
        self._listener: _Listener | None = None
        self._core: Core | None = None
        self._wal: Any = None
        self._thread: threading.Thread | None = None
        self._address: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._started = False

    # -- public ----------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port listened on (the one picked, if created with port 0)."""
        if self._address is None:
            raise StoreError("the store server is not started")
        return self._address[1]

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) listened on."""
        if self._address is None:
            raise StoreError("the store server is not started")
        return self._address

    def stats(self) -> dict[str, int]:
        """The server's numbers now: ``connections``, ``sessions``, ``keys``; the memory budget
        (``memory_budget``, the server's own ``memory_base`` at start), the bytes buffered for
        clients (``buffered_bytes``: ``buffered_input_bytes`` + ``buffered_output_bytes``) and
        the connections dropped to stay within it (``shed_connections``)."""
        if self._core is None:
            raise StoreError("the store server is not started")
        return self._core.stats()

    def metrics(self) -> ServerMetricsSnapshot:
        """The server's counters and histograms now (requests by operation, request latency,
        write-ahead log bytes and fsync time, sessions expired) with :meth:`stats`: what
        :mod:`rdzv.monitor` exposes to Prometheus. Safe to call from any thread."""
        if self._core is None:
            raise StoreError("the store server is not started")
        return self._core.metrics_snapshot()

    def directories(self, prefix: str) -> list[str]:
        """The directories right under ``prefix`` (ending with ``/``) that hold keys, e.g. the
        runs of ``rdzv/``: read from any thread without a request."""
        if self._core is None:
            raise StoreError("the store server is not started")
        return self._core.state.subdirs(prefix)

    @property
    def failed(self) -> BaseException | None:
        """The error that stopped the server (a write-ahead log failure), if any."""
        return self._core.failed if self._core is not None else None

    def start(self) -> "StoreServer":
        """Serve from a background thread; returns once the server is listening."""
        self._claim()
        self._open()
        self._thread = threading.Thread(target=self._run, name="rdzv-store-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM (when in the main thread) or stop()."""
        self._claim()
        self._open()
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self._run()
        finally:
            for restored, handler in previous.items():
                signal.signal(restored, handler)
        if self._core is not None and self._core.failed is not None:
            raise StoreError(f"the store server stopped: {self._core.failed}") from self._core.failed

    def stop(self) -> None:
        """Stop serving: close the listener and every connection (sessions are kept in the log)."""
        loop = self._loop
        if loop is None:
            return
        if not self._stopped.is_set():
            loop.stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> "StoreServer":
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"{self._address[0]}:{self._address[1]}" if self._address else "not started"
        return f"StoreServer({where})"

    # -- internals --------------------------------------------------------------------------------
    def _claim(self) -> None:
        with self._lock:
            if self._started:
                raise StoreError("the store server was already started")
            self._started = True

    def _on_signal(self, sig: int, frame: Any) -> None:
        log.info("received %s; stopping the store server", signal.Signals(sig).name)
        assert self._loop is not None
        self._loop.stop()

    def _open(self) -> None:
        """Recover the data, listen, and set up the loop (in the calling thread)."""
        raise_nofile_limit()
        loop = EventLoop()
        try:
            state = KVState()
            if self._data_dir is not None:
                from ._wal import WriteAheadLog

                self._wal = WriteAheadLog(self._data_dir, fsync=self._fsync)
                state = self._wal.recover()
                state.effects = []
            sock = self._sock if self._sock is not None else _listen_socket(self.host, self._port)
            base = 0
            if self._budget_covers_process:
                return_freed_memory(pin=True)
                base = resident_bytes()
            core = Core(
                loop, state, self._wal, self._secret, self._max_frame_size, self._memory_budget, base
            )
            core.on_fatal = lambda exc: loop.stop()
            self._core = core
            self._listener = _Listener(core, sock)
        except BaseException:
            self._cleanup(loop)
            raise
        self._loop = loop
        name = sock.getsockname()
        self._address = (name[0], name[1])
        log.info(
            "rdzv store server listening on %s:%d (%s, %s)",
            name[0],
            name[1],
            f"data in {os.fspath(self._data_dir)}, fsync={self._fsync}"
            if self._data_dir is not None
            else "in memory",
            "shared-secret auth" if self._secret else "no auth",
        )
        budget = core.budget
        log.info(
            "memory budget %.1f MiB: the server takes %.1f MiB, client buffers up to %.1f MiB",
            budget.limit / (1 << 20), budget.base / (1 << 20), budget.for_buffers / (1 << 20),
        )
        if state.session_ttls:
            log.info("recovered %d session(s); awaiting their clients", len(state.session_ttls))

    def _run(self) -> None:
        assert self._loop is not None
        try:
            self._loop.run()
        finally:
            self._cleanup(self._loop)

    def _cleanup(self, loop: EventLoop) -> None:
        core = self._core
        try:
            if core is not None:
                core.stopping = True
                if core.failed is None:
                    core.commit()  # log and send whatever is pending
            if self._listener is not None:
                self._listener.close()
            if core is not None:
                for conn in list(core.conns):
                    conn.lost(None)
        except Exception:  # pragma: no cover - best effort on the way out
            log.exception("error while stopping the store server")
        finally:
            if self._wal is not None:
                try:
                    self._wal.close()
                except Exception:  # pragma: no cover
                    log.exception("error closing the write-ahead log")
                self._wal = None
            loop.close()
            self._stopped.set()
