"""Suite-wide rule: in CI (``CI=true``) the real dependencies must be there.

Tests that need torch, an etcd server, prometheus_client or a browser (Chromium driven by
Playwright) skip with a reason on a developer's machine that lacks them; under CI the whole run
stops at once instead, naming what is missing, so that a broken install step in ``scripts/test``
can never pass as a run of skipped tests.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from _launcher import CHROMIUM

def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_configure(config: pytest.Config) -> None:
    if not _in_ci():
        return
    missing = []
    if importlib.util.find_spec("torch") is None:
        missing.append("torch (pip install torch==2.13.0)")
    from rdzv.etcd import EtcdNotFoundError, find_etcd_binaries

    try:
        find_etcd_binaries()
    except EtcdNotFoundError:
        missing.append("an etcd server (bash scripts/install-etcd)")
    for module in ("prometheus_client", "playwright"):
        if importlib.util.find_spec(module) is None:
            missing.append(f"{module} (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"Chromium at {CHROMIUM} (bash scripts/install-chromium)")
    if missing:
        raise pytest.UsageError(
            "CI=true but the test dependencies are missing: " + "; ".join(missing)
            + ". Run the tests through scripts/test, which installs them."
        )
