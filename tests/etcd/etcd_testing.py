"""Test helpers: which etcd servers to test against, and the rule that CI must have one.

Locally a machine without etcd skips the etcd tests with the reason; under ``CI=true`` it fails
them, so that a broken ``scripts/install-etcd`` cannot pass unnoticed.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from rdzv.etcd import EtcdNotFoundError, etcd_version, find_etcd_binaries

MISSING = "no etcd server binary found: run `bash scripts/install-etcd` or set RDZV_ETCD_BINARY"


def _binaries() -> list[tuple[str, str]]:
    try:
        return [(binary, etcd_version(binary)) for binary in find_etcd_binaries()]
    except EtcdNotFoundError:
        return []


def etcd_params() -> list[Any]:
    """One pytest param per etcd version found (e.g. ``etcd3.4.23``), or one ``None`` param."""
    found: dict[str, str] = {}
    for binary, version in _binaries():
        found.setdefault(version, binary)
    if not found:
        return [pytest.param(None, id="no-etcd")]
    return [pytest.param(binary, id=f"etcd{version}") for version, binary in found.items()]


def require_etcd(binary: str | None) -> str:
    """``binary``, or skip (locally) / fail (under CI=true) the test when there is none."""
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(MISSING + " (CI must test against a real etcd)")
        pytest.skip(MISSING)
    return binary
