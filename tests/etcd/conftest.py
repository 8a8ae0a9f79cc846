"""Fixtures for the etcd tests: an etcd binary per installed version (see etcd_testing)."""

from __future__ import annotations

import pytest
from etcd_testing import etcd_params, require_etcd


@pytest.fixture(scope="module", params=etcd_params())
def etcd_binary(request: pytest.FixtureRequest) -> str:
    """Each installed etcd version in turn (skipped locally / failed in CI when none)."""
    return require_etcd(request.param)
