"""A real Slurm cluster for the tests of this directory: ``scripts/slurm-cluster`` starts slurmctld
and three slurmd (``n1``..``n3``, all at 127.0.0.1) with munge in a temporary directory, once per
module, and stops them by pid afterwards. Jobs are submitted with the real ``sbatch``, ended with
the real ``scancel`` and ``scontrol requeue``, and looked at with ``scontrol show job``.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Iterator

import pytest
from _slurmcluster import SCRIPT, Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = [name for name in ("slurmctld", "slurmd", "munged", "sbatch")
               if shutil.which(name) is None]
    if missing:  # (CI=true: tests/conftest.py fails the run instead)
        pytest.skip(f"no Slurm here ({', '.join(missing)}): bash scripts/slurm-cluster install")
    path = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SCRIPT), "start", str(path)], capture_output=True,
                             text=True, timeout=90, check=False)
    try:
        assert started.returncode == 0, f"the Slurm cluster did not start: {started.stderr}"
        yield Cluster(path)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(path)], capture_output=True,
                       timeout=90, check=False)
