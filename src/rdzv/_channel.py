"""The channel between an agent and its workers: a Unix socket, one JSON object a line.

A worker that uses the in-process API (``rdzv.torch.ElasticState``) connects to the socket
named by ``RDZV_AGENT_CHANNEL`` and says ``hello``; a worker that does not simply never
connects, and its agent restarts it on a membership change as before. Messages (``op``):

agent -> worker:
    ``plan``    the next round: the worker's new rank and world size, the new group's store
                (``master_addr``/``master_port``/``prefix``), ``leave`` (this node leaves).
    ``switch``  switch at ``step`` (the number of completed steps); ``source`` sends the state
                to ``receivers`` (global ranks of the new group).
    ``abort``   a member of the group is lost: abort the group (a pending collective fails).
    ``recover`` the survivors' new group is ready: ``source`` (the survivor that completed the
                most steps) sends its state to ``receivers``.
    ``join``    to a newcomer: the group it joins gets its state from ``source``.
    ``query``   asks for ``progress``.
worker -> agent:
    ``hello``     ``local_rank``, ``pid``.
    ``progress``  ``step`` and the recent ``step_time`` in seconds (None before a step).
    ``switched``  the new group is up (``ms``: the pause), or ``left`` for a leaving worker.
    ``missed``    the switch step had already passed (the agent falls back to a restart).
    ``failed``    the switch failed in the worker (``error``).
    ``broken``    a collective failed (a peer is gone): the worker waits for ``recover`` with
                  its completed ``step``.

The channel is local to one machine (a socket file only the agent's user can open) and carries
JSON only. This module does the framing and checking; the agent side is :class:`ChannelServer`,
the worker side :class:`ChannelClient`. It sits below both ``rdzv.agent`` and ``rdzv.torch``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
from typing import Any, Callable

from .errors import RendezvousError

logger = logging.getLogger(__name__)

ENV_CHANNEL = "RDZV_AGENT_CHANNEL"
"""The socket a worker connects to (set by ``rdzv run`` for every worker)."""
ENV_JOIN = "RDZV_INPROCESS_JOIN"
"""Set for a worker started to join a running group in-process: the new group's store prefix."""
MAX_LINE = 1 << 20
OPS_TO_WORKER = frozenset({"plan", "switch", "abort", "recover", "join", "query"})
OPS_TO_AGENT = frozenset({"hello", "progress", "switched", "missed", "failed", "broken"})


class ChannelError(RendezvousError):
    """A message on the agent-worker channel is malformed or the channel is gone."""


def _hang_up(sock: socket.socket) -> None:
    """Close ``sock`` so that its peer and a thread reading it here both see the end."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes, ops: frozenset[str]) -> dict[str, Any]:
    """One line as a message whose ``op`` is in ``ops``, or ChannelError saying what is wrong."""
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise ChannelError(f"not JSON on the agent channel: {line[:80]!r}") from exc
    if not isinstance(message, dict) or message.get("op") not in ops:
        raise ChannelError(f"unknown message on the agent channel: {line[:80]!r}")
    return message


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
    connection ends is reported as ``on_message(local_rank, {"op": "closed"})``.
    """

    def __init__(self, on_message: Callable[[int, dict[str, Any]], None]) -> None:
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
                message = decode(line, OPS_TO_AGENT)
                if message["op"] == "hello":
                    local_rank = int(message["local_rank"])
                    with self._lock:
                        previous = self._workers.get(local_rank)
                        self._workers[local_rank] = conn
                    if previous is not None:
                        _hang_up(previous)
                if local_rank is None or not self._current(local_rank, conn):
                    break  # no hello yet, or a connection forgotten since: its worker is gone
                self._on_message(local_rank, message)
        except (ChannelError, KeyError, TypeError, ValueError) as exc:
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
                self._on_message(local_rank, {"op": "closed"})

    def _current(self, local_rank: int, conn: socket.socket) -> bool:
        with self._lock:
            return self._workers.get(local_rank) is conn

    def connected(self) -> frozenset[int]:
        """The local ranks whose workers are connected now."""
        with self._lock:
            return frozenset(self._workers)

    def send(self, local_rank: int, message: dict[str, Any]) -> bool:
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
        for path in (self.path, self._dir):
            try:
                os.unlink(path) if path == self.path else os.rmdir(path)
            except OSError:
                pass


class ChannelClient:
    """The worker's end: ``on_message`` runs on a reader thread for each message of the agent,
    and once with ``{"op": "closed"}`` when the agent has gone."""

    def __init__(self, path: str, local_rank: int,
                 on_message: Callable[[dict[str, Any]], None]) -> None:
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
        self.send({"op": "hello", "local_rank": local_rank, "pid": os.getpid()})
        threading.Thread(target=self._read, daemon=True, name="rdzv-agent-channel").start()

    def _read(self) -> None:
        lines = _Lines(self._sock)
        while True:
            line = lines.read()
            if line is None:
                self._on_message({"op": "closed"})
                return
            try:
                message = decode(line, OPS_TO_WORKER)
            except ChannelError as exc:
                logger.warning("%s", exc)
                continue
            self._on_message(message)

    def send(self, message: dict[str, Any]) -> None:
        """Send a message to the agent (ignored if the agent is gone: it stops this worker)."""
        with self._send_lock:
            try:
                self._sock.sendall(encode(message))
            except OSError as exc:
                logger.warning("cannot tell the agent %s: %s", message.get("op"), exc)

    def close(self) -> None:
        _hang_up(self._sock)
