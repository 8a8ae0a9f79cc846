"""The on-disk format of the write-ahead log and snapshot files: headers, records, snapshots.

Both kinds of file start with a header (magic, format version, generation, CRC32) followed by
records: ``<u32 length><u32 crc32(payload)><u32 crc32(those 8 bytes)>`` then the payload, whose
first byte is the record type: an effect in the one encoding of :mod:`rdzv.kv` (the FileStore
writes the same), or one of the log's own records. The header checksum tells a corrupted length (an error) from a
record cut short at the end of the file (a torn write). A log also holds, after the effects of
each write request, a SessionRequest: the session's last applied write (its request id and
answer), so that a write resent after a restart is not applied twice. A snapshot holds a meta
record (revision, last session id, counts), then one Put per key, one SessionOpen per session,
the SessionRequest of each session that wrote, and one PathRevision per path. No I/O here but
whole-file reads and the writing of a snapshot file.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import NamedTuple, Union

from ..errors import RendezvousStateError, StoreError
from ..kv import (
    FIRST_FORMAT_TYPE,
    Delete,
    Effect,
    KVState,
    Put,
    SessionClose,
    SessionOpen,
    decode_effect,
    decode_key,
    encode_effect,
    encode_key,
    is_effect,
)

FORMAT_VERSION = 3
"""The version of the file format written (2 added SessionRequest records, 3 the sessions'
resume tokens); files of a newer version are refused."""

LOG_MAGIC = b"RDZVWAL\x00"
SNAPSHOT_MAGIC = b"RDZVSNP\x00"
_FILE_HEADER = struct.Struct("<8sIQI")  # magic, format version, generation, crc32 of the rest
FILE_HEADER_SIZE = _FILE_HEADER.size
_LENGTH_CRC = struct.Struct("<II")  # payload length, crc32(payload)
_RECORD_HEADER = struct.Struct("<III")  # the above, then crc32 of those 8 bytes

_PATH_REVISION, _SNAPSHOT_META, _REQUEST = range(FIRST_FORMAT_TYPE, FIRST_FORMAT_TYPE + 3)
"""The log's and snapshot's own records; effects are encoded by :func:`rdzv.kv.encode_effect`."""
_PATH_REVISION_HEAD = struct.Struct("<BQ")  # type, revision; then the path
_SNAPSHOT_META_BODY = struct.Struct("<BQQQQQ")  # type, revision, last session, counts x3
_REQUEST_HEAD = struct.Struct("<BQIB")  # type, session, request id, has answer; then the answer


class SessionRequest(NamedTuple):
    """Log and snapshot record: the last write ``session`` had applied, request ``rid``, and
    the response frame it was answered with (None: a quiet SET, not answered)."""

    session: int
    rid: int
    answer: bytes | None


class _PathRevision(NamedTuple):
    """Snapshot record: ``path`` last changed at ``revision``."""

    path: str
    revision: int


class _SnapshotMeta(NamedTuple):
    """Snapshot record (the first): the counters and how many records of each kind follow."""

    revision: int
    last_session: int
    keys: int
    sessions: int
    paths: int


_Record = Union[Put, Delete, SessionOpen, SessionClose, SessionRequest, _PathRevision, _SnapshotMeta]
LogRecord = Union[Effect, SessionRequest]
"""What a log holds: the effects, and the requests that caused them."""


# -- encoding ------------------------------------------------------------------------------------
def _frame(payload: bytes) -> bytes:
    """One record: its checksummed header, then ``payload``."""
    head = _LENGTH_CRC.pack(len(payload), zlib.crc32(payload))
    return head + zlib.crc32(head).to_bytes(4, "little") + payload


def encode(record: _Record) -> bytes:
    """The framed record of an effect (or of a snapshot-only record)."""
    if isinstance(record, (Put, Delete, SessionOpen, SessionClose)):
        return _frame(encode_effect(record))
    if isinstance(record, SessionRequest):
        answer = record.answer
        head = _REQUEST_HEAD.pack(_REQUEST, record.session, record.rid, answer is not None)
        return _frame(head + (answer or b""))
    if isinstance(record, _PathRevision):
        return _frame(_PATH_REVISION_HEAD.pack(_PATH_REVISION, record.revision) + encode_key(record.path))
    if isinstance(record, _SnapshotMeta):
        return _frame(_SNAPSHOT_META_BODY.pack(_SNAPSHOT_META, *record))
    raise TypeError(f"cannot log {record!r}: not a Put, Delete, SessionOpen or SessionClose")


def decode(payload: bytes) -> _Record:
    """The record held by a payload whose checksum passed; ValueError if it makes no sense."""
    if is_effect(payload):
        return decode_effect(payload)
    kind = payload[0] if payload else None
    if kind == _PATH_REVISION:
        revision = _PATH_REVISION_HEAD.unpack_from(payload)[1]
        return _PathRevision(decode_key(payload[_PATH_REVISION_HEAD.size :]), revision)
    if kind == _REQUEST:
        _, session, rid, answered = _REQUEST_HEAD.unpack_from(payload)
        return SessionRequest(session, rid, payload[_REQUEST_HEAD.size :] if answered else None)
    if kind == _SNAPSHOT_META:
        return _SnapshotMeta(*_SNAPSHOT_META_BODY.unpack(payload)[1:])
    raise ValueError(f"unknown record type {kind}")


def file_header(magic: bytes, generation: int) -> bytes:
    fields = struct.pack("<8sIQ", magic, FORMAT_VERSION, generation)
    return fields + zlib.crc32(fields).to_bytes(4, "little")


# -- decoding files ------------------------------------------------------------------------------
class Scan(NamedTuple):
    """The records of one file, and where and why reading stopped early (if it did)."""

    records: list[tuple[int, bytes]]  # (offset, payload)
    end: int  # offset just after the last intact record
    problem: str | None  # what is wrong at ``end``; None if the file ended cleanly
    torn: bool  # whether the damage looks like a write cut short by a crash
    size: int  # of the file


def _zeros_from(data: bytes, offset: int) -> bool:
    return data.count(0, offset) == len(data) - offset


def scan_records(data: bytes, offset: int) -> Scan:
    records: list[tuple[int, bytes]] = []
    size = len(data)
    view = memoryview(data)
    while offset < size:
        if size - offset < _RECORD_HEADER.size:
            return Scan(records, offset, "an incomplete record header", True, size)
        length, crc, head_crc = _RECORD_HEADER.unpack_from(data, offset)
        if zlib.crc32(view[offset : offset + _LENGTH_CRC.size]) != head_crc:
            problem = "a record header whose checksum does not match"
            return Scan(records, offset, problem, _zeros_from(data, offset), size)
        start = offset + _RECORD_HEADER.size
        end = start + length
        if end > size:
            problem = f"a record cut short ({size - start} of its {length} bytes are present)"
            return Scan(records, offset, problem, True, size)
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            problem = "a record whose checksum does not match"
            return Scan(records, offset, problem, end == size or _zeros_from(data, end), size)
        records.append((offset, payload))
        offset = end
    return Scan(records, offset, None, False, size)


def corrupt(path: Path, offset: int, problem: str, advice: str) -> RendezvousStateError:
    return RendezvousStateError(
        f"{path} is corrupt at byte offset {offset}: {problem}. {advice} "
        "Keep a copy of the data dir before changing anything (see docs/durability.md)."
    )


def check_header(data: bytes, path: Path, magic: bytes, generation: int) -> None:
    if len(data) < _FILE_HEADER.size or data[:8] != magic:
        raise RendezvousStateError(
            f"{path} is not an rdzv {'log' if magic == LOG_MAGIC else 'snapshot'} file (its "
            f"first bytes are {data[:8]!r}); move it out of the data dir {path.parent} or point "
            "the server at another data dir"
        )
    _, version, file_generation, crc = _FILE_HEADER.unpack_from(data)
    if zlib.crc32(data[: _FILE_HEADER.size - 4]) != crc:
        raise corrupt(path, 0, "the file header checksum does not match", "Restore it from a backup.")
    if version > FORMAT_VERSION:
        raise RendezvousStateError(
            f"{path} was written by a newer rdzv (file format {version}; this rdzv reads up to "
            f"format {FORMAT_VERSION}): upgrade rdzv to recover this data dir"
        )
    if file_generation != generation:
        raise corrupt(
            path, 0, f"its header says generation {file_generation}, its name {generation}",
            "Was it renamed? Give it back its name wal-/snapshot-<generation in its header>.",
        )


def read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror}; check the data dir's permissions") from exc


def _decode_at(path: Path, offset: int, payload: bytes, advice: str) -> _Record:
    try:
        return decode(payload)
    except (ValueError, struct.error) as exc:
        raise corrupt(path, offset, f"an unreadable record ({exc})", advice) from exc


def read_log(path: Path, generation: int) -> tuple[list[LogRecord], Scan]:
    """The records in a log file, and how reading it ended (the caller judges a damaged end)."""
    data = read_file(path)
    check_header(data, path, LOG_MAGIC, generation)
    scan = scan_records(data, _FILE_HEADER.size)
    effects: list[LogRecord] = []
    for offset, payload in scan.records:
        record = _decode_at(path, offset, payload, "Restore it from a backup.")
        if not isinstance(record, (Put, Delete, SessionOpen, SessionClose, SessionRequest)):
            raise corrupt(path, offset, "a snapshot record inside a log", "Restore it from a backup.")
        effects.append(record)
    return effects, scan


def read_snapshot(path: Path, generation: int) -> tuple[KVState, dict[int, SessionRequest]]:
    """The state held by a snapshot file, and each session's last write; RendezvousStateError
    if it is damaged in any way."""
    data = read_file(path)
    check_header(data, path, SNAPSHOT_MAGIC, generation)
    scan = scan_records(data, _FILE_HEADER.size)
    advice = (
        "If an older snapshot-*.snap and every wal-*.log from its generation on are in the data "
        "dir, move this snapshot out of it and restart; otherwise restore the data dir from a backup."
    )
    if scan.problem is not None:
        raise corrupt(path, scan.end, scan.problem, advice)
    state = KVState()
    paths: dict[str, int] = {}
    requests: dict[int, SessionRequest] = {}
    meta: _SnapshotMeta | None = None
    counts = {_SnapshotMeta: 0, Put: 0, SessionOpen: 0, _PathRevision: 0}
    for offset, payload in scan.records:
        record = _decode_at(path, offset, payload, advice)
        kind = type(record)
        if isinstance(record, SessionRequest) and meta is not None:
            requests[record.session] = record
            continue
        if kind not in counts or (meta is None) != (kind is _SnapshotMeta):
            raise corrupt(path, offset, f"a misplaced {kind.__name__} record", advice)
        counts[kind] += 1
        if isinstance(record, _SnapshotMeta):
            meta = record
        elif isinstance(record, _PathRevision):
            paths[record.path] = record.revision
        elif isinstance(record, (Put, SessionOpen)):
            state.apply(record)
    expected = (1, meta.keys, meta.sessions, meta.paths) if meta else (1, 0, 0, 0)
    if tuple(counts.values()) != expected:
        raise corrupt(path, scan.end, f"it holds {tuple(counts.values())} records of each "
                       f"kind (meta, keys, sessions, paths) instead of {expected}", advice)
    assert meta is not None
    state.restore_revisions(meta.revision, meta.last_session, paths)
    return state, requests


def write_snapshot(
    path: Path, state: KVState, generation: int, requests: dict[int, SessionRequest]
) -> int:
    """Write ``state`` and the sessions' last writes to ``path`` and fsync it; its size."""
    items = state.items()
    paths = state.path_revisions()
    sessions = dict(state.session_ttls)
    meta = _SnapshotMeta(state.revision, state.last_session, len(items), len(sessions), len(paths))
    with open(path, "wb") as file:
        file.write(file_header(SNAPSHOT_MAGIC, generation))
        file.write(encode(meta))
        for key, value, session in items:
            file.write(encode(Put(state.path_revision(key), key, value, session)))
        tokens = state.session_tokens
        for session, ttl in sessions.items():
            file.write(encode(SessionOpen(session, ttl, tokens.get(session, b""))))
        for session, request in requests.items():
            if session in sessions:
                file.write(encode(request))
        for name, revision in paths.items():
            file.write(encode(_PathRevision(name, revision)))
        file.flush()
        os.fsync(file.fileno())
        return file.tell()


