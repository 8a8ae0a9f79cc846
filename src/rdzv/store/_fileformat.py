"""The FileStore's file format: a header, then CRC-checked records of state effects.

A file starts with a fixed header (magic, format version, this file's random id, the id of the
file it was compacted from, and the offset where records after the compaction snapshot start).
Each record is ``length (u32) + crc32 (u32) + payload``; the payload is the effects of one
mutation (so a mutation is applied whole or not at all), each as ``u32 length`` + the effect in
the one encoding of :mod:`rdzv.kv` (the server's log writes the same). A compacted file starts
with one snapshot record that rebuilds the whole state, ending with a :class:`Revision`.

Version 1 (rdzv before the shared encoding) packed its effects its own way; such a file is
still read, and rewritten in version 2 by the first client that writes (every client but a
``read_only`` one opens a session, a write: ``FileStore._convert``). Encoding and decoding do no
I/O.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple, Sequence, Union

from ..errors import RendezvousStateError
from ..kv import (
    FIRST_FORMAT_TYPE,
    Delete,
    Effect,
    KVState,
    Put,
    SessionClose,
    SessionOpen,
    decode_effect,
    encode_effect,
    is_effect,
)

MAGIC = b"RDZVFILE"
VERSION = 2
"""The version written (2: effects in the shared encoding); version 1 files are read too."""
_HEADER = struct.Struct("<8sIQQQI")  # magic, version, file id, parent id, data start, crc32
HEADER_SIZE = _HEADER.size
_RECORD = struct.Struct("<II")  # payload length, crc32 of payload
_LENGTH = struct.Struct("<I")  # of one item of a record
_REVISION = struct.Struct("<BQ")  # type, revision
_T_REVISION = FIRST_FORMAT_TYPE
MAX_RECORD = 1 << 31


class Revision(NamedTuple):
    """Snapshot effect: the store's revision counter is at least ``revision``."""

    revision: int


FileEffect = Union[Effect, Revision]


class Header(NamedTuple):
    file_id: int
    parent_id: int
    data_start: int
    version: int = VERSION


def encode_header(header: Header) -> bytes:
    fields = (MAGIC, header.version, header.file_id, header.parent_id, header.data_start)
    body = _HEADER.pack(*fields, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def decode_header(data: bytes, file_name: str) -> Header:
    """The header at the start of ``data``; RendezvousStateError if this is no FileStore file."""
    if data.startswith(MAGIC) and len(data) < HEADER_SIZE:
        raise RendezvousStateError(
            f"{file_name}: truncated FileStore header ({len(data)} bytes at offset 0); "
            "its creator died while writing it: remove the file and restart the job"
        )
    if not data.startswith(MAGIC):
        raise RendezvousStateError(
            f"{file_name} is not an rdzv FileStore file (no {MAGIC.decode()} header); "
            "torch's FileStore files and other files cannot be shared: pass a new path"
        )
    magic, version, file_id, parent_id, data_start, crc = _HEADER.unpack_from(data)
    if zlib.crc32(data[: HEADER_SIZE - 4]) != crc:
        raise RendezvousStateError(f"{file_name}: corrupt FileStore header at offset 0")
    if version not in _PAYLOAD_DECODERS:
        raise RendezvousStateError(
            f"{file_name} has FileStore format version {version}; this rdzv reads versions "
            f"1 to {VERSION}: use the same rdzv version on every host, or a new path"
        )
    return Header(file_id, parent_id, data_start, version)


def encode_record(effects: Sequence[FileEffect]) -> bytes:
    items = [_REVISION.pack(_T_REVISION, e.revision) if isinstance(e, Revision) else encode_effect(e)
             for e in effects]
    payload = b"".join(_LENGTH.pack(len(item)) + item for item in items)
    if len(payload) >= MAX_RECORD:
        raise ValueError(f"a FileStore write is limited to {MAX_RECORD} bytes, got {len(payload)}")
    return _RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def _decode_payload(payload: bytes) -> list[FileEffect]:
    effects: list[FileEffect] = []
    pos, end = 0, len(payload)
    while pos < end:
        (length,) = _LENGTH.unpack_from(payload, pos)
        item = payload[pos + _LENGTH.size : pos + _LENGTH.size + length]
        if len(item) != length:
            raise ValueError("effect runs past the end of its record")
        pos += _LENGTH.size + length
        if is_effect(item):
            effects.append(decode_effect(item))
        elif item[:1] == bytes([_T_REVISION]):
            effects.append(Revision(_REVISION.unpack(item)[1]))
        else:
            raise ValueError(f"unknown effect type {item[:1].hex() or 'none'}")
    return effects


_V1_PUT = struct.Struct("<BQQII")  # type, revision, session, key length, value length
_V1_DELETE = struct.Struct("<BQI")  # type, revision, key length
_V1_SESSION_OPEN = struct.Struct("<BQd")  # type, session, ttl
_V1_ID = struct.Struct("<BQ")  # type, session (SessionClose) or revision (Revision)


def _decode_payload_v1(payload: bytes) -> list[FileEffect]:
    """Version 1's records: the same effects, each packed with its lengths up front."""
    effects: list[FileEffect] = []
    pos, end = 0, len(payload)
    while pos < end:
        kind = payload[pos]
        if kind == 1:
            _, revision, session, key_len, value_len = _V1_PUT.unpack_from(payload, pos)
            pos += _V1_PUT.size
            key = payload[pos : pos + key_len].decode()
            value = payload[pos + key_len : pos + key_len + value_len]
            pos += key_len + value_len
            effects.append(Put(revision, key, value, session))
        elif kind == 2:
            _, revision, key_len = _V1_DELETE.unpack_from(payload, pos)
            pos += _V1_DELETE.size + key_len
            effects.append(Delete(revision, payload[pos - key_len : pos].decode()))
        elif kind == 3:
            _, session, ttl = _V1_SESSION_OPEN.unpack_from(payload, pos)
            pos += _V1_SESSION_OPEN.size
            effects.append(SessionOpen(session, ttl))
        elif kind in (4, 5):
            _, number = _V1_ID.unpack_from(payload, pos)
            pos += _V1_ID.size
            effects.append(SessionClose(number) if kind == 4 else Revision(number))
        else:
            raise ValueError(f"unknown effect type {kind}")
    if pos != end:
        raise ValueError("effect runs past the end of its record")
    return effects


_PAYLOAD_DECODERS = {1: _decode_payload_v1, VERSION: _decode_payload}


def decode_records(
    data: bytes, offset: int, file_name: str, version: int = VERSION
) -> tuple[list[list[FileEffect]], int]:
    """The records that ``data`` (read at file ``offset`` of a file of format ``version``)
    holds in full, and their total size.

    An incomplete last record (its writer died mid-write) is left out; a record whose CRC or
    content is wrong raises RendezvousStateError naming the file and the record's offset.
    """
    decode_payload = _PAYLOAD_DECODERS[version]
    records: list[list[FileEffect]] = []
    pos = 0
    while len(data) - pos >= _RECORD.size:
        length, crc = _RECORD.unpack_from(data, pos)
        start = pos + _RECORD.size
        if len(data) - start < length:
            break
        payload = data[start : start + length]
        try:
            if zlib.crc32(payload) != crc:
                raise ValueError("CRC mismatch")
            records.append(decode_payload(payload))
        except (ValueError, struct.error, UnicodeDecodeError) as exc:
            raise RendezvousStateError(
                f"{file_name}: corrupt FileStore record at offset {offset + pos} ({exc}); "
                "the file was damaged or written by something else: remove it and restart the job"
            ) from exc
        pos = start + length
    return records, pos


def snapshot_effects(state: KVState, last_session: int) -> list[FileEffect]:
    """Effects that rebuild ``state`` in an empty KVState (the start of a compacted file).

    Every key gets the current revision, so revisions never go backwards for any reader; the
    last session id is kept (opened and closed again if it ended) so ids are never reused.
    """
    effects: list[FileEffect] = [SessionOpen(s, ttl) for s, ttl in state.session_ttls.items()]
    if last_session and last_session not in state.session_ttls:
        effects += (SessionOpen(last_session, 0.0), SessionClose(last_session))
    effects += (Put(state.revision, key, value, session) for key, value, session in state.items())
    effects.append(Revision(state.revision))
    return effects


def apply_effect(state: KVState, effect: FileEffect) -> None:
    """Replay one effect read from the file into ``state``."""
    if isinstance(effect, Revision):
        state.revision = max(state.revision, effect.revision)
    else:
        state.apply(effect)
