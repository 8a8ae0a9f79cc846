"""Shared-secret authentication: HMAC-SHA256 challenge-response at the handshake.

The secret itself never crosses the wire. The client sends a random nonce in its HELLO, the
server one in its CHALLENGE; the client answers with ``HMAC(secret, "client" + both nonces)``
and the server proves in its WELCOME that it knows the secret too
(``HMAC(secret, "server" + both nonces)``), so a client with a secret never talks to an impostor.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Union

SECRET_ENV = "RDZV_STORE_SECRET"
"""Environment variable holding the shared secret (CLI server and TCPStore clients)."""

Secret = Union[str, bytes, None]

_CLIENT = b"rdzv-store-auth-v1 client\x00"
_SERVER = b"rdzv-store-auth-v1 server\x00"


def normalize_secret(secret: Secret) -> bytes | None:
    """The secret as bytes (str is UTF-8 encoded); None or empty means no authentication."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"the store secret must be str or bytes, not {type(secret).__name__}")
    return bytes(secret) or None


def secret_from_env() -> bytes | None:
    """The secret in ``$RDZV_STORE_SECRET``, if set and not empty."""
    return normalize_secret(os.environ.get(SECRET_ENV))


def shared_secret(secret_file: str | os.PathLike | None) -> bytes | None:
    """The one rule for a store's shared secret: the one in ``secret_file`` if it is given
    (``--secret-file``, the tcp backend's ``secret_file=``), else ``$RDZV_STORE_SECRET``, else
    none (no authentication). OSError or ValueError for a file that cannot be read or is
    empty."""
    return read_secret_file(secret_file) if secret_file else secret_from_env()


def read_secret_file(path: str | os.PathLike) -> bytes:
    """The secret stored in a file (a trailing newline is not part of it)."""
    with open(path, "rb") as f:
        data = f.read().rstrip(b"\r\n")
    if not data:
        raise ValueError(f"the secret file {os.fspath(path)!r} is empty")
    return data


def new_nonce(size: int = 32) -> bytes:
    return os.urandom(size)


def client_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, _CLIENT + client_nonce + server_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, _SERVER + client_nonce + server_nonce, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, got)
