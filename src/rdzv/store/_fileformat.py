"""The FileStore's file format: a header, then CRC-checked records of state effects.

A file starts with a fixed header (magic, format version, this file's random id, the id of the
file it was compacted from, and the offset where records after the compaction snapshot start).
Each record is ``length (u32) + crc32 (u32) + payload``; the payload is the list of effects of
one mutation (so a mutation is applied whole or not at all). A compacted file starts with one
snapshot record that rebuilds the whole state. Encoding and decoding do no I/O.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple, Sequence, Union

from ..errors import RendezvousStateError
from ..kv import Delete, Effect, KVState, Put, SessionClose, SessionOpen

MAGIC = b"RDZVFILE"
VERSION = 1
_HEADER = struct.Struct("<8sIQQQI")  # magic, version, file id, parent id, data start, crc32
HEADER_SIZE = _HEADER.size
_RECORD = struct.Struct("<II")  # payload length, crc32 of payload
_PUT = struct.Struct("<BQQII")  # type, revision, session, key length, value length
_DELETE = struct.Struct("<BQI")  # type, revision, key length
_SESSION_OPEN = struct.Struct("<BQd")  # type, session, ttl
_ID = struct.Struct("<BQ")  # type, session (SessionClose) or revision (Revision)
_T_PUT, _T_DELETE, _T_OPEN, _T_CLOSE, _T_REVISION = range(1, 6)
MAX_RECORD = 1 << 31


class Revision(NamedTuple):
    """Snapshot effect: the store's revision counter is at least ``revision``."""

    revision: int


FileEffect = Union[Effect, Revision]


class Header(NamedTuple):
    file_id: int
    parent_id: int
    data_start: int


def encode_header(header: Header) -> bytes:
    fields = (MAGIC, VERSION, header.file_id, header.parent_id, header.data_start)
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
    if version != VERSION:
        raise RendezvousStateError(
            f"{file_name} has FileStore format version {version}; this rdzv reads version "
            f"{VERSION}: use the same rdzv version on every host, or a new path"
        )
    return Header(file_id, parent_id, data_start)


def encode_record(effects: Sequence[FileEffect]) -> bytes:
    parts: list[bytes] = []
    for effect in effects:
        if isinstance(effect, Put):
            key = effect.key.encode()
            parts += (
                _PUT.pack(_T_PUT, effect.revision, effect.session, len(key), len(effect.value)),
                key,
                effect.value,
            )
        elif isinstance(effect, Delete):
            key = effect.key.encode()
            parts += (_DELETE.pack(_T_DELETE, effect.revision, len(key)), key)
        elif isinstance(effect, SessionOpen):
            parts.append(_SESSION_OPEN.pack(_T_OPEN, effect.session, effect.ttl))
        elif isinstance(effect, SessionClose):
            parts.append(_ID.pack(_T_CLOSE, effect.session))
        else:
            parts.append(_ID.pack(_T_REVISION, effect.revision))
    payload = b"".join(parts)
    if len(payload) >= MAX_RECORD:
        raise ValueError(f"a FileStore write is limited to {MAX_RECORD} bytes, got {len(payload)}")
    return _RECORD.pack(len(payload), zlib.crc32(payload)) + payload


def _decode_payload(payload: bytes) -> list[FileEffect]:
    effects: list[FileEffect] = []
    pos, end = 0, len(payload)
    while pos < end:
        kind = payload[pos]
        if kind == _T_PUT:
            _, revision, session, key_len, value_len = _PUT.unpack_from(payload, pos)
            pos += _PUT.size
            key = payload[pos : pos + key_len].decode()
            value = payload[pos + key_len : pos + key_len + value_len]
            pos += key_len + value_len
            effects.append(Put(revision, key, value, session))
        elif kind == _T_DELETE:
            _, revision, key_len = _DELETE.unpack_from(payload, pos)
            pos += _DELETE.size + key_len
            effects.append(Delete(revision, payload[pos - key_len : pos].decode()))
        elif kind == _T_OPEN:
            _, session, ttl = _SESSION_OPEN.unpack_from(payload, pos)
            pos += _SESSION_OPEN.size
            effects.append(SessionOpen(session, ttl))
        elif kind in (_T_CLOSE, _T_REVISION):
            _, number = _ID.unpack_from(payload, pos)
            pos += _ID.size
            effects.append(SessionClose(number) if kind == _T_CLOSE else Revision(number))
        else:
            raise ValueError(f"unknown effect type {kind}")
    if pos != end:
        raise ValueError("effect runs past the end of its record")
    return effects


def decode_records(
    data: bytes, offset: int, file_name: str
) -> tuple[list[list[FileEffect]], int]:
    """The records that ``data`` (read at file ``offset``) holds in full, and their total size.

    An incomplete last record (its writer died mid-write) is left out; a record whose CRC or
    content is wrong raises RendezvousStateError naming the file and the record's offset.
    """
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
            records.append(_decode_payload(payload))
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
