"""The etcd client's HTTP/1.1 connection against a loopback server that sends exact bytes.

etcd's gateway answers with Content-Length, with chunks, with trailers after an error's chunks
(``Grpc-Trailer-Content-Type``), and streams watch events as chunks; the bytes here are those
answers, delivered in awkward pieces.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Iterator

import pytest

from rdzv.etcd._http import HTTPConnection, HTTPProtocolError

OK_LENGTH = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
)
ERROR_WITH_TRAILER = (
    b"HTTP/1.1 404 Not Found\r\nTrailer: Grpc-Trailer-Content-Type\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n6\r\n{\"x\":1\r\n1\r\n}\r\n0\r\n"
    b"Grpc-Trailer-Content-Type: application/grpc\r\n\r\n"
)
STREAM = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"8\r\n{\"n\":1}\n\r\n4\r\n{\"n\"\r\n4\r\n:2}\n\r\n0\r\n\r\n"
)


class CannedServer:
    """Accepts one connection; answers each request with the next canned reply, byte by byte
    in small pieces; then keeps the connection open until the test ends."""

    def __init__(self, replies: list[bytes]) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.listener.settimeout(30)
        self.endpoint = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        self.replies = replies
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(30)
        with conn:
            for reply in self.replies:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                self.requests.append(request)
                for start in range(0, len(reply), 5):
                    conn.sendall(reply[start : start + 5])
                    time.sleep(0.001)
            self.done.wait(30)

    def close(self) -> None:
        self.done.set()
        self.thread.join(30)
        self.listener.close()


@pytest.fixture
def serve() -> Iterator[list[CannedServer]]:
    servers: list[CannedServer] = []
    yield servers
    for server in servers:
        server.close()


def test_answers_with_length_and_chunks_with_trailers_on_one_connection(
    serve: list[CannedServer],
) -> None:
    server = CannedServer([OK_LENGTH, ERROR_WITH_TRAILER, OK_LENGTH])
    serve.append(server)
    conn = HTTPConnection(server.endpoint, 30)
    assert conn.post("/v3/kv/range", b'{"key":"YQ=="}', {"X-A": "1"}) == (200, b'{"a":1}')
    assert conn.post("/v3/kv/put", b"{}", {}) == (404, b'{"x":1}')
    assert conn.reusable, "the trailers were read: the connection can carry the next request"
    assert conn.post("/v3/kv/range", b"{}", {}) == (200, b'{"a":1}')
    conn.close()
    first = server.requests[0]
    assert first.startswith(b"POST /v3/kv/range HTTP/1.1\r\n")
    assert b"Content-Length: 14\r\n" in first and b"X-A: 1\r\n" in first


def test_streamed_lines_across_chunks(serve: list[CannedServer]) -> None:
    server = CannedServer([STREAM])
    serve.append(server)
    conn = HTTPConnection(server.endpoint, 30)
    status, head = conn.send("/v3/watch", b"{}", {})
    assert status == 200
    conn.begin_stream(head)
    assert conn.next_line(30) == b'{"n":1}\n'
    assert conn.next_line(30) == b'{"n":2}\n'
    assert conn.next_line(30) == b"", "the stream ended"
    assert not conn.reusable
    conn.close()


def test_a_silent_stream_times_out_and_keeps_what_it_read(serve: list[CannedServer]) -> None:
    server = CannedServer([STREAM[: STREAM.index(b"4\r\n:2}")]])
    serve.append(server)
    conn = HTTPConnection(server.endpoint, 30)
    conn.begin_stream(conn.send("/v3/watch", b"{}", {})[1])
    assert conn.next_line(30) == b'{"n":1}\n'
    with pytest.raises(socket.timeout):
        conn.next_line(0.3)
    conn.close()


def test_garbage_and_early_close_are_connection_errors(serve: list[CannedServer]) -> None:
    server = CannedServer([b"SSH-2.0-OpenSSH\r\n\r\n"])
    serve.append(server)
    conn = HTTPConnection(server.endpoint, 30)
    with pytest.raises(HTTPProtocolError, match="answered with 'SSH-2.0"):
        conn.post("/v3/kv/range", b"{}", {})
    conn.close()
    server = CannedServer([OK_LENGTH[:-3]])
    serve.append(server)
    conn = HTTPConnection(server.endpoint, 30)
    server.done.set()  # the server closes after half the body
    with pytest.raises(ConnectionError, match="closed the connection"):
        conn.post("/v3/kv/range", b"{}", {})
    conn.close()
