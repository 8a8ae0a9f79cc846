"""The agent-worker channel over a real Unix socket: messages both ways, garbage refused."""

from __future__ import annotations

import os
import queue
import socket
import stat
from typing import Any

import pytest

from rdzv._channel import ChannelClient, ChannelError, ChannelServer
from rdzv._messages import (
    TO_AGENT,
    TO_WORKER,
    Abort,
    Broken,
    Closed,
    Hello,
    Plan,
    PlanKind,
    Progress,
    decode,
    encode,
)


def test_a_worker_says_hello_and_messages_go_both_ways() -> None:
    seen: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    server = ChannelServer(lambda rank, message: seen.put((rank, message)))
    got: queue.SimpleQueue[Any] = queue.SimpleQueue()
    try:
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600  # this user's only
        client = ChannelClient(server.path, 3, got.put, fresh=True)
        assert seen.get(timeout=5) == (3, Hello(3, os.getpid(), True))
        assert server.connected() == frozenset({3})
        plan = Plan(7, PlanKind.SWITCH, step=50, source=0, rank=2, world_size=3,
                    master_addr="127.0.0.1", master_port=29500, prefix="rdzv-x")
        assert server.send(3, Abort()) and server.send(3, plan)
        assert [got.get(timeout=5), got.get(timeout=5)] == [Abort(), plan]
        client.send(Progress(7, 0.06))
        assert seen.get(timeout=5) == (3, Progress(7, 0.06))
        assert not server.send(5, Abort())  # no such worker
        client.close()
        assert seen.get(timeout=5) == (3, Closed())
    finally:
        server.close()
    assert not os.path.exists(server.path)


def test_every_message_survives_its_encoding() -> None:
    for message in (Broken(40, fresh=False, round=3, error="gloo: peer gone"),
                    Plan(1, PlanKind.LEAVE, step=9), Hello(0, 1)):
        types = TO_WORKER if isinstance(message, Plan) else TO_AGENT
        assert decode(encode(message), types) == message


@pytest.mark.parametrize("line", [
    b"not json", b"[1, 2]", b'{"type": "reboot"}', b'{"no": "type"}',
    b'{"type": "progress"}', b'{"type": "progress", "step": "7"}',
    b'{"type": "broken", "step": true}', b'{"type": "entered", "round": 1, "ms": "x", "step": 1}',
    b'{"type": ["progress"]}', b'{"type": {"a": 1}}',
])
def test_garbage_on_the_channel_is_refused_and_the_agent_goes_on(line: bytes) -> None:
    seen: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    server = ChannelServer(lambda rank, message: seen.put((rank, message)))
    try:
        with pytest.raises(ChannelError):
            decode(line, TO_AGENT)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(server.path)
        raw.sendall(b'{"type":"hello","local_rank":0,"pid":1}\n' + line + b"\n")
        assert isinstance(seen.get(timeout=5)[1], Hello)
        assert seen.get(timeout=5) == (0, Closed())  # dropped, not crashed
        raw.close()
        good = ChannelClient(server.path, 1, lambda message: None)
        assert seen.get(timeout=5)[0] == 1  # the next worker is served
        good.close()
    finally:
        server.close()


def test_a_worker_without_its_agent_gets_a_clear_error(tmp_path: Any) -> None:
    with pytest.raises(ChannelError, match="cannot reach this node's rdzv agent"):
        ChannelClient(str(tmp_path / "gone.sock"), 0, lambda message: None)
