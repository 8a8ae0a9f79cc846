"""The store's wire protocol: a pure codec (bytes in, values out), no I/O. Spec: ``docs/protocol.md``.

Every message is a *frame*: a little-endian ``u32`` body length, then the body. A connection
starts with a handshake (HELLO, CHALLENGE, AUTH, WELCOME), then carries requests
(``u8 op, u32 request id, arguments``) and responses (``u8 status, u32 request id, payload``).
Strings and byte strings inside a body are ``u32`` length + bytes, except that the last field of
a body may take "the rest of the frame". Keys are UTF-8.

Decoding never trusts its input: any malformed body raises :class:`ProtocolError` (a
:class:`~rdzv.errors.StoreProtocolError`), never another exception.

This module gathers the codec's parts: :mod:`._wire` (constants, structs, framing),
:mod:`._requests`, :mod:`._responses` and :mod:`._handshake`.
"""

from __future__ import annotations

from ._handshake import *  # noqa: F401,F403
from ._requests import *  # noqa: F401,F403
from ._responses import *  # noqa: F401,F403
from ._wire import *  # noqa: F401,F403
from ._wire import _HELLO  # noqa: F401 - the HELLO struct, for tests of other versions
