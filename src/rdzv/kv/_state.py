"""The key-value state machine: data, revisions, sessions and prefix indexes, with no I/O.

Both the in-process HashStore and the store server keep their data in a :class:`KVState`; they
add the waiting, the networking and the persistence around it. Every mutating method returns the
keys it changed, so the caller can wake the readers and watchers of those keys (see
:func:`rdzv.kv.dir_paths`). When :attr:`KVState.effects` is a list, each mutation also
appends its effect as a :class:`Put`, :class:`Delete`, :class:`SessionOpen` or
:class:`SessionClose` (what a write-ahead log records and :meth:`KVState.apply` replays).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence, Union

from ..errors import StoreValueError
from ._rules import compare_set_result, conditions_hold, dir_paths


class Put(NamedTuple):
    """Effect: ``key`` now holds ``value`` (owned by ``session``, 0 if not ephemeral)."""

    revision: int
    key: str
    value: bytes
    session: int


class Delete(NamedTuple):
    """Effect: ``key`` was deleted."""

    revision: int
    key: str


class SessionOpen(NamedTuple):
    """Effect: session ``session`` was opened with a heartbeat time-to-live of ``ttl`` seconds
    (and the ``token`` its owner resumes it with, on a store server)."""

    session: int
    ttl: float
    token: bytes = b""


class SessionClose(NamedTuple):
    """Effect: session ``session`` ended (its ephemeral keys are deleted by separate effects)."""

    session: int


Effect = Union[Put, Delete, SessionOpen, SessionClose]


class Entry(NamedTuple):
    value: bytes
    session: int
    paths: tuple[str, ...]
    """The key's watch paths (:func:`~rdzv.kv.dir_paths`), computed once per key."""


def parse_counter(key: str, value: bytes | None) -> int:
    """The integer held by a counter key (missing: 0), or StoreValueError naming the key."""
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        raise StoreValueError(
            f"cannot add to key {key!r}: its value {value[:40]!r} is not an integer"
        ) from None


class KVState:
    """Keys, values, revisions and session ownership of one store."""

    def __init__(self) -> None:
        self.revision = 0
        self.effects: list[Effect] | None = None
        self.session_ttls: dict[int, float] = {}
        self.session_tokens: dict[int, bytes] = {}
        """The resume token of each session that has one (store server sessions)."""
        self._last_session = 0
        self._data: dict[str, Entry] = {}
        self._path_revision: dict[str, int] = {}
        self._dir_keys: dict[str, set[str]] = {}
        self._session_keys: dict[int, set[str]] = {}

    # -- reads ----------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        entry = self._data.get(key)
        return None if entry is None else entry.value

    def contains(self, key: str) -> bool:
        return key in self._data

    def num_keys(self) -> int:
        return len(self._data)

    def keys_under(self, prefix: str) -> list[str]:
        if prefix == "":
            return list(self._data)
        if prefix.endswith("/"):
            return list(self._dir_keys.get(prefix, ()))
        return [k for k in self._data if k.startswith(prefix)]

    def list_keys(self, prefix: str) -> dict[str, bytes]:
        data = self._data
        return {k: data[k].value for k in self.keys_under(prefix)}

    def count_keys(self, prefix: str) -> int:
        if prefix == "":
            return len(self._data)
        if prefix.endswith("/"):
            return len(self._dir_keys.get(prefix, ()))
        return sum(1 for k in self._data if k.startswith(prefix))

    def subdirs(self, prefix: str) -> list[str]:
        """The names of the directories right under ``prefix`` (which ends with ``/``) that
        hold keys. Safe from another thread: one copy of the directory list, under the GIL."""
        depth = prefix.count("/") + 1
        return sorted(
            path[len(prefix):-1]
            for path in list(self._dir_keys)
            if path.startswith(prefix) and path.count("/") == depth
        )

    def path_revision(self, path: str) -> int:
        return self._path_revision.get(path, 0)

    def items(self) -> list[tuple[str, bytes, int]]:
        """Every (key, value, session): what a snapshot holds."""
        return [(k, e.value, e.session) for k, e in self._data.items()]

    def session_keys(self, session: int) -> int:
        """How many keys ``session`` owns."""
        return len(self._session_keys.get(session, ()))

    @property
    def last_session(self) -> int:
        """The highest session id handed out so far (a snapshot keeps it: ids are never reused)."""
        return self._last_session

    def path_revisions(self) -> dict[str, int]:
        """Every path ever changed and the revision of its last change (a snapshot keeps them)."""
        return dict(self._path_revision)

    # -- writes ---------------------------------------------------------------------------------
    def set(self, key: str, value: bytes, session: int = 0) -> list[str]:
        self.revision += 1
        self._put(key, value, session, self.revision)
        return [key]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[str]:
        if len(keys) != len(values):
            raise StoreValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        self.revision += 1
        for key, value in zip(keys, values):
            self._put(key, value, 0, self.revision)
        return list(keys)

    def multi_set_if(
        self, conditions: Mapping[str, bytes | None], keys: Sequence[str], values: Sequence[bytes]
    ) -> tuple[bool, list[str]]:
        """:meth:`multi_set` if every condition holds (see :func:`conditions_hold`): (whether
        it wrote, the keys changed)."""
        if not conditions_hold(conditions, {key: self.get(key) for key in conditions}):
            return False, []
        return True, self.multi_set(keys, values) if keys else []

    def add(self, key: str, amount: int) -> tuple[int, list[str]]:
        entry = self._data.get(key)
        result = parse_counter(key, None if entry is None else entry.value) + amount
        self.revision += 1
        self._put(key, str(result).encode(), entry.session if entry else 0, self.revision)
        return result, [key]

    def compare_set(
        self, key: str, expected: bytes, desired: bytes, session: int = 0
    ) -> tuple[bytes, list[str]]:
        result, write = compare_set_result(self.get(key), expected, desired)
        if not write:
            return result, []
        self.revision += 1
        self._put(key, desired, session, self.revision)
        return result, [key]

    def append(self, key: str, value: bytes) -> list[str]:
        entry = self._data.get(key)
        self.revision += 1
        if entry is None:
            self._put(key, value, 0, self.revision)
        else:
            self._put(key, entry.value + value, entry.session, self.revision)
        return [key]

    def delete(self, key: str) -> list[str]:
        if key not in self._data:
            return []
        self.revision += 1
        self._remove(key, self.revision)
        return [key]

    def open_session(self, ttl: float, token: bytes = b"") -> int:
        """A new session id (never reused, also across recovery) with heartbeat ``ttl`` and
        resume ``token`` (none if empty)."""
        self._last_session += 1
        self.session_ttls[self._last_session] = ttl
        if token:
            self.session_tokens[self._last_session] = token
        if self.effects is not None:
            self.effects.append(SessionOpen(self._last_session, ttl, token))
        return self._last_session

    def close_session(self, session: int) -> list[str]:
        """End ``session`` and delete every key it owns; the keys deleted."""
        keys = sorted(self._session_keys.get(session, ()))
        if keys:
            self.revision += 1
            for key in keys:
                self._remove(key, self.revision)
        self._session_keys.pop(session, None)
        self.session_tokens.pop(session, None)
        if self.session_ttls.pop(session, None) is not None and self.effects is not None:
            self.effects.append(SessionClose(session))
        return keys

    # -- replay (recovery from a log or snapshot) --------------------------------------------
    def apply(self, effect: Effect) -> None:
        """Re-apply an effect recorded earlier (recovery), keeping its revision and ids."""
        if isinstance(effect, SessionOpen):
            self.session_ttls[effect.session] = effect.ttl
            if effect.token:
                self.session_tokens[effect.session] = effect.token
            self._last_session = max(self._last_session, effect.session)
            return
        if isinstance(effect, SessionClose):
            self.session_ttls.pop(effect.session, None)
            self.session_tokens.pop(effect.session, None)
            return
        self.revision = max(self.revision, effect.revision)
        if isinstance(effect, Put):
            self._put(effect.key, effect.value, effect.session, effect.revision)
        elif effect.key in self._data:
            self._remove(effect.key, effect.revision)

    def restore_revisions(
        self, revision: int, last_session: int, path_revisions: dict[str, int]
    ) -> None:
        """Finish restoring a snapshot (after applying its keys and sessions): its revision,
        last session id and path revisions, so neither revisions nor session ids go backwards."""
        self.revision = max(self.revision, revision)
        self._last_session = max(self._last_session, last_session)
        self._path_revision.update(path_revisions)

    # -- internals ----------------------------------------------------------------------------
    def _put(self, key: str, value: bytes, session: int, revision: int) -> None:
        old = self._data.get(key)
        path_revision = self._path_revision
        if old is None:
            paths = tuple(dir_paths(key))
            self._data[key] = Entry(value, session, paths)
            if session:
                self._session_keys.setdefault(session, set()).add(key)
            dir_keys = self._dir_keys
            for path in paths:
                path_revision[path] = revision
                if path.endswith("/") and path != key:
                    keys = dir_keys.get(path)
                    if keys is None:
                        dir_keys[path] = {key}
                    else:
                        keys.add(key)
        else:
            paths = old.paths
            self._data[key] = Entry(value, session, paths)
            if old.session != session:
                if old.session:
                    self._disown(key, old.session)
                if session:
                    self._session_keys.setdefault(session, set()).add(key)
            for path in paths:
                path_revision[path] = revision
        if self.effects is not None:
            self.effects.append(Put(revision, key, value, session))

    def _disown(self, key: str, session: int) -> None:
        owned = self._session_keys.get(session)
        if owned is not None:
            owned.discard(key)
            if not owned:
                del self._session_keys[session]

    def _remove(self, key: str, revision: int) -> None:
        entry = self._data.pop(key)
        if entry.session:
            self._disown(key, entry.session)
        for path in entry.paths:
            self._path_revision[path] = revision
            if path.endswith("/") and path != key:
                keys = self._dir_keys.get(path)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._dir_keys[path]
        if self.effects is not None:
            self.effects.append(Delete(revision, key))
