"""The chaos soak of issue 17, short, with a fixed seed: real node processes on a durable tcp
store server and on a 3-member etcd cluster, faults injected for real, every invariant checked
on the merged histories (see chaos_harness; ``scripts/chaos`` runs it long)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from chaos_harness import Config, soak

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "etcd"))
from etcd_testing import etcd_params, require_etcd  # noqa: E402

SEED = 17
CI_RUN = dict(seed=SEED, duration=20.0, pause_max=8.0, recovery_bound=30.0, hold=3.0)
"""About 30 s a backend: 20 s of faults (one of each kind at least), then the recovery."""
ETCD = etcd_params()[0].values[0]
"""The first etcd server found (None: none; a failure under CI=true)."""


@pytest.mark.timeout(240)
def test_chaos_soak_tcp(tmp_path: Path) -> None:
    outcome = soak(Config("tcp", **CI_RUN), tmp_path / "tcp")  # type: ignore[arg-type]
    print(outcome.report())
    assert not outcome.violations, outcome.report()
    assert outcome.figures["sealers paused mid-seal"] >= 1, outcome.report()
    assert outcome.figures["faults"].get("server", 0) >= 1, outcome.report()


@pytest.mark.timeout(240)
def test_chaos_soak_etcd(tmp_path: Path) -> None:
    binary = require_etcd(ETCD)
    outcome = soak(Config("etcd", etcd_binary=binary, **CI_RUN),  # type: ignore[arg-type]
                   tmp_path / "etcd")
    print(outcome.report())
    assert not outcome.violations, outcome.report()
    assert outcome.figures["faults"].get("server", 0) >= 1, outcome.report()
