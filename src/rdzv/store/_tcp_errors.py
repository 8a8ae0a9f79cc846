"""The TCPStore client's failures as rdzv errors, with what each says.

The connection (:mod:`._tcp_conn`) and its handshake raise these: a server's error answer
mapped to the rdzv error type of its code, an unreachable or lost server
(StoreConnectionError, naming the address and the socket's failure), and a session that
expired while requests or ephemeral keys of this client depended on it (SessionExpiredError).
"""

from __future__ import annotations

import socket

from ..errors import (
    SessionExpiredError,
    StoreAuthenticationError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreValueError,
)
from ..kv import protocol as P


class ConnectionLost(ConnectionError):
    """The server closed the connection (internal: triggers a reconnect)."""


def describe(exc: BaseException | None, reply_timeout: float | None = None) -> str:
    """What went wrong with a socket, in a few words (None: it was not connected)."""
    if exc is None:
        return "not connected"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (BlockingIOError, socket.timeout)):
        return f"no reply within {reply_timeout:g} s" if reply_timeout else "timed out"
    if isinstance(exc, socket.gaierror):
        return (f"cannot resolve the host name ({exc.strerror}; a well-formed name is retried "
                "until the timeout, as a new pod's DNS name can take a while to appear)")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def answer_error(addr: str, status: int, payload: bytes, what: str, key: str | None) -> StoreError:
    """The rdzv error for the error answer of the server at ``addr`` to ``what`` (about
    ``key``)."""
    about = f"{what}({key!r})" if key is not None else what
    if status != P.STATUS_ERROR:
        return StoreProtocolError(f"unexpected response status {status} to {about}")
    code, msg = P.decode_error(payload)
    if code == P.E_VALUE:
        return StoreValueError(msg)
    if code == P.E_AUTH:
        return StoreAuthenticationError(msg)
    if code == P.E_SESSION:
        return SessionExpiredError(msg)
    if code in (P.E_BAD_REQUEST, P.E_UNKNOWN_OP, P.E_FRAME_TOO_LARGE, P.E_VERSION):
        return StoreProtocolError(f"the store server at {addr} rejected {about}: {msg}", code)
    return StoreError(f"the store server at {addr} failed {about}: {msg}")


def earlier_write_failed(err: StoreError, what: str, key: str | None) -> StoreError:
    """``err``, the failure of a pipelined write, as the next call reports it."""
    return type(err)(
        f"{what}({key!r}), sent earlier by this client, failed: {err} (reported by the "
        "next call to the server, which was itself carried out)"
    )


def closed(addr: str) -> StoreError:
    """A call on a client that was closed (or is being closed by another thread)."""
    return StoreError(f"this TCPStore ({addr}) is closed")


def closed_by_server(addr: str, payload: bytes) -> StoreProtocolError:
    """The server's last word (an error answer to request 0) before closing the connection."""
    _, msg = P.decode_error(payload)
    return StoreProtocolError(f"the store server at {addr} closed the connection: {msg}")


def frame_too_large(size: int, max_frame: int) -> StoreValueError:
    return StoreValueError(
        f"request of {size} bytes exceeds the server's maximum frame size of {max_frame} bytes"
    )


def connection_lost(addr: str, reason: BaseException | None, reply_timeout: float) -> StoreConnectionError:
    """The connection to ``addr`` was lost to ``reason`` and the call's time is up."""
    return StoreConnectionError(
        f"lost the connection to the store server at {addr} ({describe(reason, reply_timeout)})"
    )


def unreachable(
    addr: str, lost: BaseException | None, last: BaseException | None, timeout: float
) -> StoreConnectionError:
    """No connection to ``addr`` by the deadline (``last``: the last attempt's failure) after
    losing one to ``lost``, or (``lost`` None) for a first connection tried for ``timeout`` s."""
    if lost is not None:
        return StoreConnectionError(
            f"lost the connection to the store server at {addr} ({describe(lost)}) "
            f"and could not reconnect: {describe(last)}"
        )
    return StoreConnectionError(
        f"could not connect to the store server at {addr}: {describe(last)} "
        f"(tried for {timeout:g} s)"
    )


def expired_in_flight(addr: str, old: int, new: int, frame: bytes) -> SessionExpiredError:
    """The request ``frame``, unanswered when session ``old`` ended, is not sent in ``new``."""
    return SessionExpiredError(
        f"the session {old} of this client at the store server {addr} expired while its "
        f"{P.OP_NAMES[frame[4]]} request was unanswered: it may or may not have been applied, "
        f"and is not sent again in the new session {new}"
    )


def expired_while_disconnected(
    addr: str, old: int, new: int, had_ephemeral: bool, dropped: list[str]
) -> SessionExpiredError:
    """Session ``old`` ended while disconnected, with its ephemeral keys (``had_ephemeral``)
    and the unconfirmed writes not sent again (``dropped``, named)."""
    lost = ", and its ephemeral keys with it" if had_ephemeral else ""
    shown = ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else "")
    unsent = (
        f"; {len(dropped)} write(s) sent in it were not confirmed and are not sent "
        f"again (each may or may not have been applied): {shown}" if dropped else ""
    )
    return SessionExpiredError(
        f"the session {old} of this client at the store server {addr} expired while "
        f"disconnected{lost}{unsent} (now in session {new})"
    )
