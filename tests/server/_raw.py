"""A raw protocol client for server tests: frames in, frames out, nothing hidden."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

from rdzv.kv import auth
from rdzv.kv import protocol as P
from _waiting import eventually as wait_until  # noqa: F401 (re-exported to the tests)

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


class Raw:
    """A socket speaking the store protocol by hand."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.session = 0
        self.token = b""
        self.welcome: P.Welcome | None = None

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed by the server")
            data += chunk
        return data

    def frame(self) -> bytes:
        (length,) = P.LEN.unpack(self.exactly(4))
        return self.exactly(length)

    def handshake(
        self,
        *,
        secret: bytes | None = None,
        resume: int = 0,
        token: bytes = bytes(P.TOKEN_SIZE),
        ttl: float = 30.0,
    ) -> P.Welcome:
        nonce = os.urandom(16)
        self.send(P.encode_hello(ttl, resume, token, nonce, secret is not None))
        challenge = P.decode_challenge(self.frame())
        assert challenge.status == P.HS_OK, challenge
        mac = auth.client_proof(secret, nonce, challenge.nonce) if secret else b""
        self.send(P.encode_auth(mac))
        welcome = P.decode_welcome(self.frame())
        self.session = welcome.session
        self.token = welcome.token
        self.welcome = welcome
        return welcome

    def call(self, request: bytes) -> tuple[int, int, bytes]:
        """Send one request frame; (status, request id, payload) of the answer."""
        self.send(request)
        return P.decode_response(self.frame())

    def closed_by_server(self, within: float = 10.0) -> bool:
        """Whether the server closes this connection (reading and dropping anything it sends)."""
        self.sock.settimeout(within)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False

    def close(self) -> None:
        self.sock.close()


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RDZV_STORE_SECRET", None)
    return env


def start_server_process(*args: str, port: int = 0, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """``python -m rdzv serve`` in a child process; (process, port) once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
        stderr=subprocess.PIPE,
        text=True,
        env=env or python_env(),
    )
    lines = []
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    for line in proc.stderr:
        lines.append(line)
        found = re.search(r"listening on [^ ]+:(\d+)", line)
        if found:
            _drain(proc)
            return proc, int(found.group(1))
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the store server did not start:\n" + "".join(lines))


def _drain(proc: subprocess.Popen) -> None:
    """Keep reading the child's stderr so that it never blocks on a full pipe."""
    import threading

    def run() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            proc.log_lines.append(line)  # type: ignore[attr-defined]

    proc.log_lines = []  # type: ignore[attr-defined]
    threading.Thread(target=run, daemon=True).start()

