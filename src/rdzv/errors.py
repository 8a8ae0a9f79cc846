"""The error hierarchy of rdzv: every error the library raises derives from RendezvousError.

The rendezvous errors carry torch's names (``torch.distributed.elastic.rendezvous``) so that
code written against torch catches them unchanged. Store errors also derive from
``RuntimeError``, as torch's ``DistStoreError`` does.
"""

from __future__ import annotations

from typing import Sequence


class RendezvousError(Exception):
    """The root of every error rdzv raises."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job has ended and no new round will form."""


class RendezvousTimeoutError(RendezvousError):
    """A rendezvous or store operation did not complete in time. Not retryable as such."""


class RendezvousConnectionError(RendezvousError):
    """The backend (store server, etcd, filesystem) could not be reached or was lost."""


class SourceUnavailable(RendezvousConnectionError):
    """The web view (``--web``) cannot read its runs' store now (the message says why); the next
    read tries again (re-exported as ``rdzv.monitor.SourceUnavailable``)."""


class RendezvousStateError(RendezvousError):
    """The rendezvous state is corrupt, foreign or of an unknown version."""


class RendezvousParameterError(RendezvousError, ValueError):
    """A rendezvous parameter, option or URL is invalid; the message says which and how to fix it."""


class RendezvousBackendError(RendezvousError, RuntimeError):
    """A backend's creator returned a handler of another backend (torch raises RuntimeError)."""


class RendezvousGracefulExitError(RendezvousError):
    """This node was asked to leave the job and should exit cleanly."""


class StoreError(RendezvousError, RuntimeError):
    """A key-value store operation failed."""


class StoreTimeoutError(StoreError, RendezvousTimeoutError, TimeoutError):
    """A blocking store call (get, wait, multi_get) timed out; ``keys`` names what was awaited."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys

    @classmethod
    def waiting_for(cls, keys: Sequence[str], seconds: float) -> "StoreTimeoutError":
        """The error of a wait on ``keys`` that lasted ``seconds`` without success.

        Its message starts with torch's words (``wait timeout after 300000ms, keys: ...``), so
        code that matches torch's message matches rdzv's too.
        """
        shown = ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
        return cls(
            f"wait timeout after {seconds * 1000:.0f}ms, keys: {shown} (waited {seconds:g} s; "
            "raise the store's timeout, or check that the writer runs)",
            tuple(keys),
        )


class QueueEmptyError(StoreError):
    """``queue_pop(key, block=False)`` found the queue empty (torch's ``QueueEmptyError``)."""


class StoreConnectionError(StoreError, RendezvousConnectionError, ConnectionError):
    """The store server could not be reached, or the connection to it was lost."""


class StoreAuthenticationError(StoreConnectionError):
    """The store server refused this client's credentials (or their absence)."""


class StoreProtocolError(StoreConnectionError):
    """The peer spoke an incompatible protocol version or sent malformed data.

    ``code``: the protocol's error code when the server sent one (e.g. unknown operation)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class StoreValueError(StoreError, ValueError):
    """The request was well formed but its values are invalid (e.g. ``add`` on a non-integer)."""


class SessionExpiredError(StoreError):
    """This client's session (and so its ephemeral keys) expired or was revoked."""


class StoreUnsupportedError(StoreError, NotImplementedError):
    """The store (or its server) cannot carry out this operation: see its capabilities."""
