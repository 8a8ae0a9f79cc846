"""One keep-alive HTTP/1.1 connection to an etcd member, as lean as the JSON gateway allows.

A request is sent in a single write (headers and body together: no second segment for the
server to wait for), and an answer is read with Content-Length or chunked framing, either
whole (unary calls) or line by line (watch streams). This replaces ``http.client``, whose
header parsing and separate body write cost more CPU per request than etcd's answer itself.
"""

from __future__ import annotations

import socket
import ssl

_MAX_HEAD = 64 * 1024
"""Longest status line plus headers accepted from the server."""
_RECV = 65536


class HTTPProtocolError(ConnectionError):
    """The server's answer broke HTTP/1.1 framing; the connection is unusable."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class HTTPConnection:
    """A client connection that sends POST requests and reads their answers, one at a time.

    Socket errors surface as OSError (``socket.timeout`` when a read takes longer than the
    timeout in force), TLS errors as ``ssl.SSLError``; a connection that raised is closed.
    """

    def __init__(
        self, endpoint: str, timeout: float, context: ssl.SSLContext | None = None
    ) -> None:
        host, port = split_endpoint(endpoint)
        self.endpoint = endpoint
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                sock = context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        self.sock: socket.socket | None = sock
        self._buffer = bytearray()
        self._reusable = True
        self._chunk_left = 0
        """Bytes left in the current chunk of a streamed answer (-1: the stream ended)."""
        self._stream_chunked = True
        self._lines = bytearray()

    # -- requests --------------------------------------------------------------------------------
    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """Send a POST and read its whole answer: (status, body)."""
        status, head = self.send(path, body, headers)
        return status, self.read_body(head)

    def read_body(self, head: dict[str, str]) -> bytes:
        """The whole body of the answer whose headers were ``head``."""
        if head.get("transfer-encoding", "").lower() == "chunked":
            answer = bytearray()
            while True:
                size = self._chunk_size()
                if size == 0:
                    self._skip_trailers()
                    break
                answer += self._read_exact(size)
                self._read_line()
            data = bytes(answer)
        elif "content-length" in head:
            data = self._read_exact(_int_header(head, "content-length"))
        else:  # the answer ends when the server closes the connection
            self._reusable = False
            data = self._read_to_close()
        if head.get("connection", "").lower() == "close":
            self._reusable = False
        return data

    def send(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
        """Send a POST and read the status line and headers of its answer."""
        if self.sock is None:
            raise ConnectionError(f"the connection to {self.endpoint} is closed")
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.endpoint}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        return self._read_head()

    # -- streamed answers ------------------------------------------------------------------------
    def begin_stream(self, head: dict[str, str]) -> None:
        """Read the answer whose headers were ``head`` line by line with :meth:`next_line`."""
        self._reusable = False
        if head.get("transfer-encoding", "").lower() != "chunked":
            self._stream_chunked = False
            length = _int_header(head, "content-length") if "content-length" in head else 0
            self._chunk_left = length if length > 0 else -1

    def next_line(self, timeout: float) -> bytes:
        """The next newline-terminated line of a chunked answer (b"" once the stream ended).

        Raises ``socket.timeout`` if no complete line arrived within ``timeout`` seconds; what
        was read so far is kept for the next call.
        """
        assert self.sock is not None
        self.sock.settimeout(timeout)
        while True:
            end = self._lines.find(b"\n")
            if end >= 0:
                line = bytes(self._lines[: end + 1])
                del self._lines[: end + 1]
                return line
            if self._chunk_left < 0:
                line, self._lines = bytes(self._lines), bytearray()
                return line
            if self._chunk_left == 0 and not self._stream_chunked:
                self._chunk_left = -1
                continue
            if self._chunk_left == 0:
                size = self._chunk_size()
                if size == 0:
                    self._skip_trailers()
                    self._chunk_left = -1
                    continue
                self._chunk_left = size
            data = self._read_some(self._chunk_left)
            self._lines += data
            self._chunk_left -= len(data)
            if self._chunk_left == 0 and self._stream_chunked:
                self._read_line()  # the CRLF after the chunk

    @property
    def reusable(self) -> bool:
        """Whether another request may be sent on this connection."""
        return self._reusable and self.sock is not None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # -- reading ---------------------------------------------------------------------------------
    def _read_head(self) -> tuple[int, dict[str, str]]:
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self._buffer) > _MAX_HEAD:
                raise HTTPProtocolError(f"{self.endpoint} sent over {_MAX_HEAD} bytes of headers")
            self._fill()
        head = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        del self._buffer[: end + 4]
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HTTPProtocolError(f"{self.endpoint} answered with {head[0][:80]!r}")
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if parts[0] == "HTTP/1.0":
            self._reusable = False
        return int(parts[1]), headers

    def _chunk_size(self) -> int:
        line = self._read_line().split(b";", 1)[0].strip()
        try:
            return int(line, 16)
        except ValueError:
            message = f"{self.endpoint} sent a bad chunk size {line[:20]!r}"
            raise HTTPProtocolError(message) from None

    def _skip_trailers(self) -> None:
        """Read the trailer fields after a chunked body's last chunk, up to the empty line."""
        for _ in range(_MAX_HEAD):
            if not self._read_line():
                return
        raise HTTPProtocolError(f"{self.endpoint} sent endless trailers")

    def _read_line(self) -> bytes:
        while True:
            end = self._buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 2]
                return line
            if len(self._buffer) > _MAX_HEAD:
                raise HTTPProtocolError(f"{self.endpoint} sent an overlong line")
            self._fill()

    def _read_exact(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._fill()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _read_some(self, most: int) -> bytes:
        if not self._buffer:
            self._fill()
        data = bytes(self._buffer[:most])
        del self._buffer[:most]
        return data

    def _read_to_close(self) -> bytes:
        assert self.sock is not None
        while True:
            data = self.sock.recv(_RECV)
            if not data:
                break
            self._buffer += data
        data, self._buffer = bytes(self._buffer), bytearray()
        return data

    def _fill(self) -> None:
        assert self.sock is not None
        data = self.sock.recv(_RECV)
        if not data:
            raise ConnectionResetError(f"{self.endpoint} closed the connection mid-answer")
        self._buffer += data


def _int_header(headers: dict[str, str], name: str) -> int:
    value = headers[name]
    if not value.isdigit():
        raise HTTPProtocolError(f"bad {name} header {value[:20]!r}")
    return int(value)
