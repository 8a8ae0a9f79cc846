"""The key-value kernel shared by the stores and the store server, with no I/O.

* :mod:`rdzv.kv.protocol` -- the store's wire protocol, a pure codec (spec: ``docs/protocol.md``);
* :mod:`rdzv.kv.auth` -- the handshake's shared-secret proofs and the one rule that finds a
  store's secret (:func:`~rdzv.kv.auth.shared_secret`);
* :class:`KVState` -- the key-value state machine (data, revisions, sessions) that the in-process
  and file stores and the server keep their data in, with its effects (:class:`Put`,
  :class:`Delete`, :class:`SessionOpen`, :class:`SessionClose`);
* the one binary encoding of those effects (:func:`encode_effect`), written by the server's
  log and by the FileStore;
* the rules every holder of the data applies (compare-set, conditions, watch paths, the
  default session ttl).

``rdzv.store`` and ``rdzv.server`` import this floor, never each other (but for the embedded
server that ``TCPStore(is_master=True)`` starts).
"""

from __future__ import annotations

from . import auth, protocol
from ._effects import (
    FIRST_FORMAT_TYPE,
    decode_effect,
    decode_key,
    encode_effect,
    encode_key,
    is_effect,
)
from ._rules import DEFAULT_SESSION_TTL, compare_set_result, conditions_hold, dir_paths
from ._state import Delete, Effect, KVState, Put, SessionClose, SessionOpen, parse_counter

__all__ = [
    "DEFAULT_SESSION_TTL",
    "FIRST_FORMAT_TYPE",
    "Delete",
    "Effect",
    "KVState",
    "Put",
    "SessionClose",
    "SessionOpen",
    "auth",
    "compare_set_result",
    "conditions_hold",
    "decode_effect",
    "decode_key",
    "dir_paths",
    "encode_effect",
    "encode_key",
    "is_effect",
    "parse_counter",
    "protocol",
]
