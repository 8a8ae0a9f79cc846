"""The chaos soak's stores: a durable ``rdzv serve`` (tcp) or a 3-member etcd cluster, each with
a server fault (SIGKILL and restart), and a checker that writes acknowledged keys meanwhile and
verifies them after every restart.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from pathlib import Path
from typing import Callable, Protocol

from _launcher import Launcher, LoggedProcess, free_port
from _waiting import eventually

from rdzv.errors import RendezvousError
from rdzv.store import Store, TCPStore

logger = logging.getLogger(__name__)

SERVER_START_TIMEOUT = 30.0
CHECK_TIMEOUT = 60.0
CHECKER_PERIOD = 0.05
CHECK_PREFIX = "chaos-check/"


class Backend(Protocol):
    name: str

    def start(self) -> None: ...
    def url(self, run_id: str, options: str) -> str: ...
    def kill_server(self) -> str:
        """SIGKILL a server (tcp: the store server; etcd: the leader); returns what was killed."""
        ...
    def restart_server(self) -> None: ...
    def client(self) -> Store:
        """A new store client in the rendezvous' key space (the checker's, the audit's)."""
        ...
    def close(self) -> None: ...


def wait_listening(port: int, timeout: float = SERVER_START_TIMEOUT) -> None:
    eventually(lambda: socket.create_connection(("127.0.0.1", port), timeout=1.0).close() or True,
               timeout, f"a store server listening on port {port}", ignoring=(OSError,))


class TcpBackend:
    """``rdzv serve --data-dir`` in a process of its own, killed and restarted on the same data."""

    name = "tcp"

    def __init__(self, workdir: Path, launcher: Launcher) -> None:
        self._launcher = launcher
        self._data_dir = workdir / "store-data"
        self._data_dir.mkdir()
        self.port = free_port()
        self._server: LoggedProcess | None = None

    def start(self) -> None:
        self._server = self._launcher.start([
            sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--data-dir", str(self._data_dir), "--fsync", "never", "--log-level", "WARNING"])
        wait_listening(self.port)

    def url(self, run_id: str, options: str) -> str:
        return f"tcp://127.0.0.1:{self.port}/{run_id}?is_host=false&{options}"

    def kill_server(self) -> str:
        assert self._server is not None
        pid = self._server.pid
        self._server.kill()
        return f"rdzv serve (pid {pid})"

    def restart_server(self) -> None:
        self.start()

    def client(self) -> Store:
        return TCPStore("127.0.0.1", self.port, timeout=10.0)

    def close(self) -> None:
        pass  # the launcher stops the server with every other process


class EtcdBackend:
    """A 3-member etcd cluster on loopback; the server fault kills the leader."""

    name = "etcd"

    def __init__(self, binary: str | None) -> None:
        from rdzv.etcd import LocalEtcdCluster

        self._cluster = LocalEtcdCluster(3, binary=binary)
        self._killed: int | None = None

    def start(self) -> None:
        self._cluster.start()

    def url(self, run_id: str, options: str) -> str:
        return f"etcd://{','.join(self._cluster.endpoints)}/{run_id}?{options}"

    def kill_server(self) -> str:
        self._killed = self._cluster.leader()
        pid = self._cluster.pid(self._killed)
        self._cluster.kill(self._killed)
        return f"etcd leader m{self._killed} (pid {pid})"

    def restart_server(self) -> None:
        assert self._killed is not None
        self._cluster.restart(self._killed)
        self._killed = None

    def client(self) -> Store:
        from rdzv.rendezvous._etcd import key_prefix
        from rdzv.store import EtcdStore

        return EtcdStore(self._cluster.endpoints, prefix=key_prefix("/rdzv"), request_timeout=3.0,
                         retry_timeout=30.0, timeout=10.0)

    def close(self) -> None:
        self._cluster.close()


class AckChecker:
    """A thread writing ``chaos-check/<i>`` one after another; a write that returned is
    acknowledged and must be read back intact after every server restart."""

    def __init__(self, client: Callable[[], Store]) -> None:
        self._client = client
        self._stop = threading.Event()
        self.acked = 0
        self._thread = threading.Thread(target=self._write, name="ack-checker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _write(self) -> None:
        store: Store | None = None
        while not self._stop.wait(CHECKER_PERIOD):
            try:
                store = store or self._client()
                key, value = f"{CHECK_PREFIX}{self.acked}", str(self.acked).encode()
                store.set(key, value)
                # TCPStore pipelines a set (it returns once sent): an answered call confirms it.
                if store.try_get(key) == value:
                    self.acked += 1
            except RendezvousError as exc:  # the server is away: the same key again later
                logger.info("checker write %d: %s", self.acked, exc)
        if store is not None:
            store.close()

    def missing(self) -> tuple[int, int]:
        """(acknowledged writes, how many of them are not intact), read by a new client."""
        acked = self.acked

        def read() -> tuple[dict[str, bytes]]:
            store = self._client()
            try:
                return (store.list_keys(CHECK_PREFIX),)
            finally:
                store.close()

        (stored,) = eventually(read, CHECK_TIMEOUT, "the checker's keys read by a new client",
                               ignoring=(RendezvousError,))  # the server may be coming back
        return acked, sum(stored.get(f"{CHECK_PREFIX}{i}") != str(i).encode()
                          for i in range(acked))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30.0)
