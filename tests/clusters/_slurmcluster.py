"""The loopback Slurm cluster of the tests in ``tests/clusters``: ``scripts/slurm-cluster``
starts it; :class:`Cluster` submits, looks at and ends its jobs with Slurm's own commands. (A
uniquely named module, imported by the tests and their conftest.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from _waiting import eventually

from rdzv.agent._slurm import records  # (the parser rdzv run reads scontrol's answers with)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm-cluster"
EXAMPLE = ROOT / "examples" / "elastic_train.py"
PRINT_RANK = ROOT / "examples" / "print_rank.py"
SBATCH_SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


class Cluster:
    """The loopback cluster in ``path``: submit, look at and end its jobs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conf = str(path / "slurm.conf")
        bin_dir = os.path.dirname(sys.executable)  # (rdzv of this virtual environment)
        self.env = dict(os.environ, SLURM_CONF=self.conf,
                        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")

    def command(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        assert done.returncode == 0, f"{' '.join(args)}: {done.stderr.strip()}"
        return done.stdout

    def sbatch(self, *options: str, wrap: str | None = None, script: Sequence[str] = (),
               cwd: Path, env: dict[str, str] | None = None, wait: bool = False) -> str:
        """Submit ``wrap`` (or the batch ``script`` with its arguments) from directory ``cwd``
        (the job's working and submit directory unless ``--chdir`` says otherwise); the job id
        (once the job has ended, with ``wait``)."""
        args = ["sbatch", "--parsable", f"--chdir={cwd}", *options,
                *([f"--wrap={wrap}"] if wrap is not None else script)]
        done = subprocess.run(args, env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=60, check=False, cwd=cwd)
        assert done.stdout.strip(), f"sbatch failed: {done.stderr.strip()}"
        job_id = done.stdout.strip().split(";")[0]
        if wait:  # (polled: sbatch --wait looks every few seconds only)
            self.wait_state(job_id, ENDED, 120)
        return job_id

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields of a job."""
        text = self.command("scontrol", "show", "job", job_id, "--oneliner")
        return next(r for r in records(text) if r.get("JobId") == job_id)

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: str, states: tuple[str, ...], within: float) -> str:
        return eventually(lambda: (s := self.state(job_id)) in states and s, within,
                          f"job {job_id} in state {'/'.join(states)}")

    def processes(self, job_id: str) -> list[int]:
        """Live processes started by this cluster for the job (its SLURM_JOB_ID in their env)."""
        wanted = {f"SLURM_CONF={self.conf}".encode(), f"SLURM_JOB_ID={job_id}".encode()}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                environ = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if wanted <= environ and stat.rpartition(")")[2].split()[0] != "Z":
                found.append(int(entry))
        return found

    def assert_no_processes(self, job_id: str, within: float = 20.0) -> None:
        eventually(lambda: not self.processes(job_id), within,
                   f"every process of job {job_id} gone")
