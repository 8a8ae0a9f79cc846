"""The channel between an agent and its workers: a Unix socket, one typed message a line.

A worker that uses the in-process API (``rdzv.torch.ElasticState``) connects to the socket
named by ``RDZV_AGENT_CHANNEL`` and says :class:`~._messages.Hello`; a worker that does not simply
never connects, and its agent restarts it on a membership change as before. The messages and
their checks are :mod:`._messages`; this module does the transport: the agent side is
:class:`ChannelServer`, the worker side :class:`ChannelClient`.

The channel is local to one machine (a socket file only the agent's user can open) and carries
JSON only. It sits below both ``rdzv.agent`` and ``rdzv.torch``.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from typing import Any, Callable

from ._messages import TO_AGENT, TO_WORKER, ChannelError, Closed, Hello, decode, encode

logger = logging.getLogger(__name__)

ENV_CHANNEL = "RDZV_AGENT_CHANNEL"
"""The socket a worker connects to (set by ``rdzv run`` for every worker)."""
ENV_JOIN = "RDZV_INPROCESS_JOIN"
"""Set (to 1) for a worker started to join a running group in-process: it holds no state and
takes its rank and group from its agent's :class:`~._messages.Plan`, not from its environment."""
ENV_JOIN_STORE = "RDZV_JOIN_STORE"
"""Set with :data:`ENV_JOIN` when every worker of the node starts to join at once: a file the
node's workers share as the store of a provisional group of their own, in which they set up
(shard the model over their node, warm up) before the running workers pause for them."""
MAX_LINE = 1 << 20
STACKS_SIGNAL = signal.SIGUSR2
"""On this signal a worker using the in-process API writes the Python stack of every thread to
:func:`stacks_file` (``rdzv.torch`` registers Python's faulthandler for it: it writes even while
the training thread is stuck in native code); its agent asks so when the worker hangs."""


def stacks_file(channel: str, local_rank: int) -> str:
    """Where the worker of ``local_rank`` writes its stacks: beside its agent's channel socket,
    in a directory only the agent's user can open."""
    return os.path.join(os.path.dirname(channel), f"stacks-{local_rank}.txt")


def _hang_up(sock: socket.socket) -> None:
    """Close ``sock`` so that its peer and a thread reading it here both see the end."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Lines:
    """Reads newline-terminated lines from a socket (bounded length)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def read(self) -> bytes | None:
        """The next line without its newline; None at the end of the stream."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_LINE:
                raise ChannelError(f"a line of over {MAX_LINE} bytes on the agent channel")
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                return None
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


class ChannelServer:
    """The agent's end: accepts its workers' connections and passes their messages on.

    ``on_message(local_rank, message)`` runs on the connection's reader thread; a worker whose
    connection ends is reported as ``on_message(local_rank, Closed())``.
    """

    def __init__(self, on_message: Callable[[int, Any], None]) -> None:
        self._on_message = on_message
        self._dir = tempfile.mkdtemp(prefix="rdzv-agent-")
        self.path = os.path.join(self._dir, "channel.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self._listener.listen(64)
        self._workers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="rdzv-channel").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="rdzv-channel-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        lines, local_rank = _Lines(conn), None
        try:
            while True:
                line = lines.read()
                if line is None:
                    break
                message = decode(line, TO_AGENT)
                if isinstance(message, Hello):
                    local_rank = message.local_rank
                    with self._lock:
                        previous = self._workers.get(local_rank)
                        self._workers[local_rank] = conn
                    if previous is not None:
                        _hang_up(previous)
                if local_rank is None or not self._current(local_rank, conn):
                    break  # no hello yet, or a connection forgotten since: its worker is gone
                self._on_message(local_rank, message)
        except ChannelError as exc:
            logger.warning("dropping a worker's channel connection: %s", exc)
        finally:
            _hang_up(conn)
            current = False
            if local_rank is not None:
                with self._lock:
                    current = self._workers.get(local_rank) is conn
                    if current:
                        del self._workers[local_rank]
            if current and local_rank is not None:  # a forgotten connection's end is no news
                self._on_message(local_rank, Closed())

    def _current(self, local_rank: int, conn: socket.socket) -> bool:
        with self._lock:
            return self._workers.get(local_rank) is conn

    def connected(self) -> frozenset[int]:
        """The local ranks whose workers are connected now."""
        with self._lock:
            return frozenset(self._workers)

    def send(self, local_rank: int, message: Any) -> bool:
        """Send ``message`` to one worker; whether it was connected and the send went out."""
        with self._lock:
            conn = self._workers.get(local_rank)
        if conn is None:
            return False
        with self._send_lock:  # whole lines, in order, from the agent's several threads
            try:
                conn.sendall(encode(message))
            except OSError:
                return False
        return True

    def forget(self) -> None:
        """Drop every worker connection (their workers were stopped)."""
        with self._lock:
            conns, self._workers = list(self._workers.values()), {}
        for conn in conns:
            _hang_up(conn)

    def close(self) -> None:
        self.forget()
        _hang_up(self._listener)
        shutil.rmtree(self._dir, ignore_errors=True)  # the socket, the workers' stack files


class ChannelClient:
    """The worker's end: ``on_message`` runs on a reader thread for each message of the agent,
    and once with :class:`~._messages.Closed` when the agent has gone."""

    def __init__(self, path: str, local_rank: int, on_message: Callable[[Any], None],
                 fresh: bool = False) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise ChannelError(
                f"cannot reach this node's rdzv agent at {path} ({exc}); {ENV_CHANNEL} names "
                "the agent of a worker started by `rdzv run`: do not set it by hand"
            ) from exc
        self._send_lock = threading.Lock()
        self._on_message = on_message
        self.send(Hello(local_rank, os.getpid(), fresh))
        threading.Thread(target=self._read, daemon=True, name="rdzv-agent-channel").start()

    def _read(self) -> None:
        lines = _Lines(self._sock)
        while True:
            line = lines.read()
            if line is None:
                self._on_message(Closed())
                return
            try:
                message = decode(line, TO_WORKER)
            except ChannelError as exc:
                logger.warning("%s", exc)
                continue
            self._on_message(message)

    @property
    def sock(self) -> socket.socket:
        return self._sock

    def send(self, message: Any) -> None:
        """Send a message to the agent (ignored if the agent is gone: it stops this worker)."""
        with self._send_lock:
            try:
                self._sock.sendall(encode(message))
            except OSError as exc:
                logger.warning("cannot tell the agent %s: %s", message.TYPE, exc)

    def close(self) -> None:
        _hang_up(self._sock)
