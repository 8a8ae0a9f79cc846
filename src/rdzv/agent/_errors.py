"""Worker failures: the ``record`` decorator, the error file it writes, and the failure summary.

A worker started by ``rdzv run`` finds the path of its error file in ``TORCHELASTIC_ERROR_FILE``.
``@record`` on the worker's entry function writes the exception there as JSON in torch's format
(``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``), so
files written by torch's own ``record`` are read the same way. The agent reads the file of each
failed worker and prints :func:`failure_summary` when it gives up.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, TypeVar

logger = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

F = TypeVar("F", bound=Callable[..., Any])


def write_error_file(exc: BaseException, path: str | None = None) -> str | None:
    """Write ``exc`` and its traceback as JSON to ``path`` (default: env TORCHELASTIC_ERROR_FILE).

    Returns the path written, or None when there is no error file to write (not under an agent).
    An existing file is kept: the first error a worker records is its root cause.
    """
    path = path or os.environ.get(ERROR_FILE_ENV)
    if not path:
        return None
    if os.path.exists(path):
        return path
    record_data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                ),
                "timestamp": str(int(time.time())),
            },
        }
    }
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(record_data, handle)
    os.replace(temporary, path)
    return path


def record(function: F) -> F:
    """Decorate a worker's entry function: an exception it raises is written to the error file.

    The exception is re-raised afterwards, so the worker still exits with an error; ``SystemExit``
    (a deliberate ``sys.exit``) is not recorded. Example::

        from rdzv.agent import record

        @record
        def main() -> None:
            ...
    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as exc:
            try:
                write_error_file(exc)
            except OSError as write_error:
                print(f"rdzv: could not write the error file: {write_error}", file=sys.stderr)
            raise

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class WorkerError:
    """What a worker wrote to its error file: the exception line and its traceback."""

    message: str
    traceback: str
    timestamp: float | None


def read_error_file(path: str) -> WorkerError | None:
    """The error recorded in ``path``, or None if the worker wrote none (or it is unreadable)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("cannot read the worker error file %s: %s", path, exc)
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):  # a worker that wrote a plain message
        return WorkerError(message, "", None)
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo") or {}
    stamp = extra.get("timestamp")
    try:
        timestamp = float(stamp) if stamp is not None else None
    except (TypeError, ValueError):
        timestamp = None
    return WorkerError(str(message.get("message", "")), str(extra.get("py_callstack", "")), timestamp)


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that ended badly: who, where, how, when, and where to look."""

    global_rank: int
    local_rank: int
    role: str
    host: str
    pid: int
    exit_code: int
    """The process's return code: > 0 an exit status, < 0 the number of the killing signal."""
    time: float
    log_files: tuple[str, ...]
    error: WorkerError | None

    @property
    def how(self) -> str:
        """'exit code 1' or 'signal SIGKILL (9)'."""
        if self.exit_code < 0:
            return f"signal {signal_name(-self.exit_code)} ({-self.exit_code})"
        return f"exit code {self.exit_code}"


def signal_name(number: int) -> str:
    """The name of signal ``number`` (``SIGKILL``), or ``signal N`` if it has none."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    """The failure to blame: the first one that recorded an error, else the earliest one."""
    recorded = [f for f in failures if f.error is not None]
    candidates = recorded or failures
    return min(candidates, key=lambda f: (f.error.timestamp or f.time) if f.error else f.time)


def failure_summary(failures: list[WorkerFailure], reason: str) -> str:
    """A report for a person: the root cause with its traceback, then the other failures."""
    if not failures:
        return f"rdzv run failed: {reason}"
    first = root_cause(failures)
    lines = [
        "=" * 72,
        f"rdzv run failed: {reason}",
        f"root cause: global rank {first.global_rank} (local rank {first.local_rank}, role "
        f"{first.role}) on host {first.host}, pid {first.pid}",
        f"  ended by:  {first.how}",
        f"  at:        {_when(first.time)}",
    ]
    if first.error is not None:
        lines.append(f"  error:     {first.error.message}")
        if first.error.traceback:
            lines.append("  traceback (from the worker's error file):")
            lines.extend("    " + line for line in first.error.traceback.rstrip().splitlines())
    else:
        lines.append(
            "  error:     no error file was written; decorate the worker's main function with "
            "rdzv.agent.record (or torch's) to see its traceback here"
        )
    lines.append(f"  logs:      {', '.join(first.log_files) or 'shown on the console only'}")
    others = [f for f in failures if f is not first]
    if others:
        lines.append("other failed workers:")
        for failure in sorted(others, key=lambda f: f.global_rank):
            message = f": {failure.error.message}" if failure.error else ""
            lines.append(
                f"  global rank {failure.global_rank} on {failure.host}: {failure.how} at "
                f"{_when(failure.time)}{message}; logs: {', '.join(failure.log_files) or '-'}"
            )
    lines.append("=" * 72)
    return "\n".join(lines)
