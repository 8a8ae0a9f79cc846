"""The training chaos soak of issue 22, short, with a fixed seed: a real ``rdzv serve``, three
real ``rdzv run`` agents training ``examples/elastic_train.py`` in-process, one fault of each
kind at least (join, leave, leave-workers, kill, stop, worker-crash), every hard invariant
checked on rank 0's progress and parameter checks (see train_chaos_harness; ``scripts/train-chaos``
runs it long, for every launcher, with the targets)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _training import JobSpec, TrainingJob, free_port
from _waiting import eventually
from train_chaos_harness import Config, Outcome, soak
from train_chaos_schedule import KINDS

CI_RUN = Config(duration=55.0, seed=23, every=5.0)
"""About 80 s: the start, 55 s of window whose first 39 s have a fault every ~5 s (seed 23:
seven faults, one of each kind first), the cleanup."""


def test_a_process_that_outlived_its_parent_is_still_the_runs(tmp_path: Path) -> None:
    """What the leftover check relies on: a process re-parented away from the job's trees is
    found by the marker in its environment, and the cleanup kills it."""
    job = TrainingJob(JobSpec("rdzv", free_port()), str(tmp_path))
    try:
        parent = job.spawn(["sh", "-c", "sleep 60 & echo $!"], "orphan.log")
        assert parent.wait(30) == 0
        orphan = int((tmp_path / "orphan.log").read_text())
        # (eventually: the orphan's environment reads empty while it is still in its exec)
        eventually(lambda: job.alive() == [orphan], 10.0, "the orphan, found by its marker")
    finally:
        job.kill_all()
    eventually(lambda: job.alive() == [], 10.0, "the orphan is gone")


@pytest.mark.timeout(300)
def test_train_chaos_soak_rdzv(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    outcome = Outcome(CI_RUN, (soak("rdzv", CI_RUN, tmp_path / "rdzv"),))
    report = outcome.report()
    print(report)
    assert not outcome.violations(), report
    injected = {e.fault.kind for e in outcome.results[0].analysis.effects}
    assert injected == set(KINDS), report
