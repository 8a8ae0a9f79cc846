"""Real etcd servers on loopback for tests and demos: one member, or a cluster with fault injection.

:class:`LocalEtcd` runs one etcd on free 127.0.0.1 ports with a temporary data dir;
:class:`LocalEtcdCluster` runs several members that form one cluster and can kill (SIGKILL),
pause (SIGSTOP), resume, stop and restart any of them. Both are context managers that stop every
process they started and delete their data.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Sequence

from ..errors import RendezvousError
from ._binary import find_etcd_binary

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_START_TRIES = 3


class LocalEtcdError(RendezvousError, RuntimeError):
    """A local etcd server could not be started or did not become healthy in time."""


@dataclass(frozen=True)
class EtcdTLSFiles:
    """PEM files that make a local etcd serve clients over https and require client certificates."""

    cert: str
    key: str
    ca: str

    def client_context(self) -> ssl.SSLContext:
        """An SSL context that trusts ``ca`` and presents this certificate (for health checks)."""
        context = ssl.create_default_context(cafile=self.ca)
        context.load_cert_chain(self.cert, self.key)
        return context


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class _Member:
    """One etcd process: its ports, data dir, command line and lifecycle."""

    def __init__(
        self, binary: str, name: str, root: str, tls: EtcdTLSFiles | None, extra_args: Sequence[str]
    ) -> None:
        self.binary = binary
        self.extra_args = list(extra_args)
        self.name = name
        self.data_dir = os.path.join(root, name)
        self.log_path = os.path.join(root, name + ".log")
        self.tls = tls
        self.client_port, self.peer_port = free_ports(2)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{LOOPBACK}:{self.peer_port}"

    def start(self, initial_cluster: str, state: str) -> None:
        args = [
            self.binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", "rdzv-local",
            "--logger", "zap",
            "--log-level", "warn",
        ]  # fmt: skip
        if self.tls:
            args += ["--cert-file", self.tls.cert, "--key-file", self.tls.key,
                     "--trusted-ca-file", self.tls.ca, "--client-cert-auth"]  # fmt: skip
        args += self.extra_args
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        logger.debug("started etcd %s (pid %d) on %s", self.name, self.process.pid, self.client_url)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        """Whether the member answers /health with ``true`` (it is up and sees a leader)."""
        context = self.tls.client_context() if self.tls else None
        try:
            with urllib.request.urlopen(
                f"{self.client_url}/health", timeout=2, context=context
            ) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def state(self) -> str | None:
        """``T`` once every thread is stopped, else another ``/proc`` state; None if unknown."""
        if self.process is None:
            return None
        tasks = f"/proc/{self.process.pid}/task"
        try:
            states = set()
            for task in os.listdir(tasks):
                with open(f"{tasks}/{task}/stat", "rb") as f:
                    states.add(f.read().rsplit(b")", 1)[1].split()[0].decode())
        except (OSError, IndexError):
            return None
        return "T" if states <= {"T", "t"} else min(states - {"T", "t"})

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def signal(self, signum: int) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signum)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; wait until the process is gone."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a paused etcd cannot handle SIGTERM
            process.terminate()
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(grace)
        self.process = None

    def kill(self) -> None:
        """SIGKILL the process, as a crash would, and reap it."""
        process = self.process
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait(10.0)
        self.process = None


def _wait_healthy(members: Sequence[_Member], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(members)
    while pending:
        for member in list(pending):
            if not member.alive():
                raise LocalEtcdError(
                    f"etcd {member.name} ({member.binary}) exited during startup:\n"
                    f"{member.log_tail()}"
                )
            if member.healthy():
                pending.remove(member)
        if pending and time.monotonic() > deadline:
            names = ", ".join(m.name for m in pending)
            raise LocalEtcdError(
                f"etcd member(s) {names} not healthy after {timeout:g} s:\n{pending[0].log_tail()}"
            )
        if pending:
            time.sleep(0.1)


class LocalEtcdCluster:
    """``size`` etcd members on loopback forming one cluster, with faults to inject.

    ``with LocalEtcdCluster(3) as cluster:`` starts them and waits (up to ``startup_timeout``)
    until every member is healthy; leaving the block stops them all and deletes their data.
    ``tls`` makes the members serve clients over https; ``extra_args`` go to every etcd.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        binary: str | None = None,
        startup_timeout: float = 60.0,
        tls: EtcdTLSFiles | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least 1 member, got size={size}")
        self.binary = binary or find_etcd_binary()
        self.startup_timeout = startup_timeout
        self.tls = tls
        self.extra_args = tuple(extra_args)
        self._size = size
        self._root: str | None = None
        self._members: list[_Member] = []

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "LocalEtcdCluster":
        """Start every member and wait until all are healthy; if another process took one of
        the chosen ports meanwhile, start again on other ports (3 tries)."""
        for attempt in range(_START_TRIES):
            try:
                return self._start_once()
            except LocalEtcdError as exc:
                if attempt == _START_TRIES - 1 or "address already in use" not in str(exc):
                    raise
                logger.warning("a port of the local etcd was taken meanwhile; trying others")
        return self

    def _start_once(self) -> "LocalEtcdCluster":
        if self._members:
            return self
        self._root = tempfile.mkdtemp(prefix="rdzv-etcd-")
        try:
            self._members = [
                _Member(self.binary, f"m{i}", self._root, self.tls, self.extra_args)
                for i in range(self._size)
            ]
            cluster = ",".join(f"{m.name}={m.peer_url}" for m in self._members)
            for member in self._members:
                member.start(cluster, "new")
            _wait_healthy(self._members, self.startup_timeout)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every member and delete the data dirs."""
        for member in self._members:
            member.stop()
        self._members = []
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> "LocalEtcdCluster":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- addresses ----------------------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client URL, in member order."""
        return [m.endpoint for m in self._members]

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    # -- fault injection ----------------------------------------------------------------------
    def _member(self, index: int) -> _Member:
        if not 0 <= index < len(self._members):
            raise IndexError(f"no member {index}: the cluster has {len(self._members)}")
        return self._members[index]

    def leader(self, timeout: float = 30.0) -> int:
        """The index of the current leader (waits up to ``timeout`` for one to be elected)."""
        deadline = time.monotonic() + timeout
        while True:
            for index, member in enumerate(self._members):
                status = self._status(member)
                if status and status.get("leader") == status["header"]["member_id"]:
                    return index
            if time.monotonic() > deadline:
                raise LocalEtcdError(f"no etcd leader elected within {timeout:g} s")
            time.sleep(0.1)

    def _status(self, member: _Member) -> dict | None:
        if not member.alive():
            return None
        context = self.tls.client_context() if self.tls else None
        request = urllib.request.Request(
            f"{member.client_url}/v3/maintenance/status", data=b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=2, context=context) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (a crash); :meth:`restart` brings it back with its data."""
        self._member(index).kill()

    def pause(self, index: int) -> None:
        """SIGSTOP member ``index``: it stays connected but answers nothing (a hung host).

        Returns once the process is stopped (where ``/proc`` shows it)."""
        member = self._member(index)
        member.signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        while member.alive() and member.state() not in ("T", None):
            if time.monotonic() > deadline:
                raise LocalEtcdError(f"etcd {member.name} did not stop after SIGSTOP")
            time.sleep(0.01)

    def resume(self, index: int) -> None:
        """SIGCONT member ``index`` after :meth:`pause`."""
        self._member(index).signal(signal.SIGCONT)

    def stop(self, index: int) -> None:
        """Shut member ``index`` down cleanly (SIGTERM, SIGKILL after 10 s)."""
        self._member(index).stop()

    def restart(self, index: int, timeout: float | None = None) -> None:
        """Start a stopped or killed member again on its data dir and wait until it is healthy."""
        member = self._member(index)
        member.stop()
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self._members)
        member.start(cluster, "existing")
        _wait_healthy([member], self.startup_timeout if timeout is None else timeout)

    def pid(self, index: int = 0) -> int | None:
        """The process id of member ``index`` (None while it is not running)."""
        process = self._member(index).process
        return process.pid if process is not None and process.poll() is None else None

    def healthy(self, index: int) -> bool:
        """Whether member ``index`` is up and sees a leader."""
        member = self._member(index)
        return member.alive() and member.healthy()


class LocalEtcd(LocalEtcdCluster):
    """One etcd server on a free loopback port with a temporary data dir.

    >>> with LocalEtcd() as etcd:            # doctest: +SKIP
    ...     store = EtcdStore(etcd.endpoint)
    """

    def __init__(
        self,
        *,
        binary: str | None = None,
        startup_timeout: float = 30.0,
        tls: EtcdTLSFiles | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(
            1, binary=binary, startup_timeout=startup_timeout, tls=tls, extra_args=extra_args
        )

    def start(self) -> "LocalEtcd":
        super().start()
        return self

    def __enter__(self) -> "LocalEtcd":
        return self.start()

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:port`` of the client URL."""
        return self.endpoints[0]

    @property
    def url(self) -> str:
        """The client URL, ``http://127.0.0.1:port`` (``https`` with TLS)."""
        return f"{self.scheme}://{self.endpoint}"
