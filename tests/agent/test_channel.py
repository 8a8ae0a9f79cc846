"""The agent-worker channel over a real Unix socket: messages both ways, garbage refused."""

from __future__ import annotations

import os
import queue
import socket
import stat
from typing import Any

import pytest

from rdzv._channel import ChannelClient, ChannelError, ChannelServer, decode


def test_a_worker_says_hello_and_messages_go_both_ways() -> None:
    seen: queue.SimpleQueue[tuple[int, dict[str, Any]]] = queue.SimpleQueue()
    server = ChannelServer(lambda rank, message: seen.put((rank, message)))
    got: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    try:
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600  # this user's only
        client = ChannelClient(server.path, 3, got.put)
        rank, hello = seen.get(timeout=5)
        assert (rank, hello["op"], hello["pid"]) == (3, "hello", os.getpid())
        assert server.connected() == frozenset({3})
        assert server.send(3, {"op": "query"})
        assert got.get(timeout=5) == {"op": "query"}
        client.send({"op": "progress", "step": 7, "step_time": 0.06})
        assert seen.get(timeout=5) == (3, {"op": "progress", "step": 7, "step_time": 0.06})
        assert not server.send(5, {"op": "query"})  # no such worker
        client.close()
        assert seen.get(timeout=5) == (3, {"op": "closed"})
    finally:
        server.close()
    assert not os.path.exists(server.path)


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b'{"op": "reboot"}', b'{"no": "op"}'])
def test_garbage_on_the_channel_is_refused_and_the_agent_goes_on(line: bytes) -> None:
    seen: queue.SimpleQueue[tuple[int, dict[str, Any]]] = queue.SimpleQueue()
    server = ChannelServer(lambda rank, message: seen.put((rank, message)))
    try:
        with pytest.raises(ChannelError):
            decode(line, frozenset({"hello"}))
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(server.path)
        raw.sendall(b'{"op":"hello","local_rank":0,"pid":1}\n' + line + b"\n")
        assert seen.get(timeout=5)[1]["op"] == "hello"
        assert seen.get(timeout=5) == (0, {"op": "closed"})  # dropped, not crashed
        raw.close()
        good = ChannelClient(server.path, 1, lambda message: None)
        assert seen.get(timeout=5)[0] == 1  # the next worker is served
        good.close()
    finally:
        server.close()


def test_a_worker_without_its_agent_gets_a_clear_error(tmp_path: Any) -> None:
    with pytest.raises(ChannelError, match="cannot reach this node's rdzv agent"):
        ChannelClient(str(tmp_path / "gone.sock"), 0, lambda message: None)
