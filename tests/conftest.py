"""Suite-wide rule: in CI (``CI=true``) the real dependencies must be there; and the headless
browser's ``page`` fixture, for the tests of the web view.

Tests that need torch, an etcd server, prometheus_client, a browser (Chromium driven by
Playwright) or Slurm (slurm-wlm and munge) skip with a reason on a developer's machine that lacks them; under CI the whole run
stops at once instead, naming what is missing, so that a broken install step in ``scripts/test``
can never pass as a run of skipped tests.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from _launcher import CHROMIUM

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


LONG_FIRST = ("torch/test_inprocess.py", "torch/test_overlaps.py", "torch/test_hsdp.py",
              "torch/test_health.py", "torch/test_torchrun.py", "clusters", "trainchaos", "torch",
              "rendezvous/test_etcd_backend_contract.py", "rendezvous/test_etcd_backend.py", "etcd",
              "agent/test_agent.py", "rendezvous/test_tcp_backend.py", "chaos",
              "store/test_torch_adapter_contract.py")
"""Folders and files that run longest (real training jobs, soaks, a Slurm cluster, two etcd
versions, torch in every peer), collected first, the longest first (in each of the two parts
``scripts/test`` runs): the workers start on them and the many short files fill the end, instead
of one long file running alone at the end while the other workers idle (the training part took
~20 s longer with the soak and the Slurm cluster, ~70 s each, last). (pyproject.toml's addopts pass ``--no-loadscope-reorder``: by default pytest-xdist
hands out the files with the most tests first, which put the longest, with few tests, last.)"""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        path = Path(str(item.fspath)).relative_to(tests)
        return next((i for i, long in enumerate(LONG_FIRST)
                     if path == Path(long) or Path(long) in path.parents), len(LONG_FIRST))

    items.sort(key=rank)  # (stable: each file's tests stay together, in order)


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
    for module in ("prometheus_client", "playwright", "yaml"):
        if importlib.util.find_spec(module) is None:
            missing.append(f"{module} (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"Chromium at {CHROMIUM} (bash scripts/install-chromium)")
    slurm = [name for name in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(name)]
    if slurm:
        missing.append(f"Slurm ({', '.join(slurm)}: bash scripts/slurm-cluster install)")
    if missing:
        raise pytest.UsageError(
            "CI=true but the test dependencies are missing: " + "; ".join(missing)
            + ". Run the tests through scripts/test, which installs them."
        )


@pytest.fixture(scope="session", autouse=True)
def _programs_started_by_tests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The environment of every program the tests start (agents, torchrun, workers, servers):

    - their temporary files (worker logs, agent channels, torch's run dirs) go under pytest's base
      directory, which pytest rotates, not into /tmp, where SIGKILLed agents' channels would pile
      up run after run;
    - one OpenMP thread per process: the tests run several nodes on one small machine, where a
      worker per node that sizes its thread pool for every core (as it should on a node of its
      own) has its idle threads spin against the other nodes' (half the CPU of a training test).
    """
    path = str(tmp_path_factory.mktemp("programs", numbered=False))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", path)
        patch.setattr(tempfile, "tempdir", path)  # (this process's own, read once and kept)
        if "OMP_NUM_THREADS" not in os.environ:  # (a developer's own choice stands)
            patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    """A page of a fresh headless Chromium (its own profile); every request it makes is
    recorded in ``page.requested``."""
    sync_api = pytest.importorskip("playwright.sync_api")  # (CI=true: tests/conftest.py fails)
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM}: bash scripts/install-chromium")
    with sync_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900})
        try:
            page = context.pages[0] if context.pages else context.new_page()
            page.requested = []
            page.expect = sync_api.expect
            page.on("request", lambda request: page.requested.append(request.url))
            yield page
        finally:
            context.close()
