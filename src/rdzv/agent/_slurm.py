"""What ``rdzv run`` takes from Slurm when it runs inside an allocation, so that it needs no flag.

Inside a job step (``srun ... rdzv run train.py``), each value the user did not give (by flag or
``PET_*`` env var) comes from Slurm:

* the run id is the job id (``SLURM_JOB_ID``): every node of the step shares it, a requeued job
  keeps it, and another allocation joins the run by naming it (``--rdzv-id JOBID``);
* the number of nodes is the step's (``SLURM_STEP_NUM_NODES``), fixed; give ``--nnodes MIN:MAX``
  for a job that other allocations may grow;
* the endpoint (tcp backend) is the job's first node, by its address as Slurm knows it
  (``scontrol show node``: ``NodeAddr``), on port :func:`job_port` (one port per job, so that jobs
  sharing a first node do not share a store); that node hosts the store (``is_host``), the others
  connect; a run id naming another running job points at that job's first node;
* this node's address (``--local-addr``) is its ``NodeAddr``;
* the node order: newcomers of a round are ranked by their node index in the step
  (``SLURM_NODEID``, the rendezvous option ``node_order``), so rank 0 is the step's first node;
* the last call (``last_call_timeout``) is 2 s: ``srun`` starts every node of the step at once,
  so a job of ``--nnodes 2:4`` on 2 nodes starts training at once, not 30 s later, and another
  allocation joins it in-process.

The batch script itself (no ``SLURM_STEP_ID``) of a multi-node allocation, and a step with several
tasks per node, get a clear error: ``rdzv run`` is one agent per node, started by ``srun``.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

logger = logging.getLogger(__name__)

BASE_PORT = 29400
PORTS = 1000
SCONTROL_TIMEOUT = 10.0
LAST_CALL = 2.0
"""Seconds a round with at least ``min_nodes`` waits for more (the option's default is 30 s):
enough for the nodes of one step, which ``srun`` starts at once."""
SRUN_HINT = "srun --ntasks-per-node=1 rdzv run ..."

Scontrol = Callable[[Sequence[str]], str]
"""Runs ``scontrol ARGS`` and returns its output (raises :class:`SlurmError`)."""


class SlurmError(ValueError):
    """Slurm's environment or ``scontrol`` cannot give what ``rdzv run`` needs; says the fix."""


@dataclass(frozen=True)
class Derived:
    """A value taken from Slurm, as a flag would give it, and where it came from."""

    value: str
    origin: str


def job_port(job_id: str) -> int:
    """The store port of a job's run: 29400 plus the job id modulo 1000."""
    return BASE_PORT + int(job_id) % PORTS


def run_scontrol(args: Sequence[str]) -> str:
    """``scontrol ARGS``'s output; a :class:`SlurmError` saying what failed otherwise."""
    command = ["scontrol", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT,
                              check=False)
    except FileNotFoundError:
        raise SlurmError("scontrol is not on PATH, so the Slurm job's nodes are unknown; give "
                         "--rdzv-endpoint HOST:PORT") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(command)}` did not answer within {SCONTROL_TIMEOUT:g} s "
                         "(is slurmctld up?); give --rdzv-endpoint HOST:PORT") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        said = lines[-1].strip() if lines else f"exit code {done.returncode}"
        raise SlurmError(f"`{' '.join(command)}` failed ({said}); give --rdzv-endpoint "
                         "HOST:PORT, or check that Slurm's commands work on this node")
    return done.stdout


def fields(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of an ``scontrol show ... --oneliner`` line."""
    pairs = (word.partition("=") for word in text.split())
    return {key: value for key, sep, value in pairs if sep}


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def derive(env: Mapping[str, str], given: Mapping[str, str | None],
           scontrol: Scontrol = run_scontrol) -> dict[str, Derived]:
    """The values ``rdzv run`` takes from Slurm, by flag name (``nnodes``, ``rdzv_id``,
    ``rdzv_endpoint``, ``local_addr``) and rendezvous option (``is_host``, ``node_order``).

    ``given`` holds what the user gave for ``rdzv_id``, ``rdzv_endpoint``, ``rdzv_backend``
    (None: not given). Raises :class:`SlurmError` where Slurm cannot say and a flag must.
    """
    job_id = env["SLURM_JOB_ID"]
    step = env.get("SLURM_STEP_ID")
    nodes = env.get("SLURM_STEP_NUM_NODES") if step is not None else env.get("SLURM_JOB_NUM_NODES")
    if step is None and nodes not in (None, "1"):
        raise SlurmError(f"this is the batch script of Slurm job {job_id}, which has {nodes} "
                         f"nodes: start one rdzv run on each node with `{SRUN_HINT}`")
    tasks = env.get("SLURM_STEP_NUM_TASKS")
    if step is not None and tasks is not None and tasks != nodes:
        raise SlurmError(f"Slurm step {job_id}.{step} runs {tasks} tasks on {nodes} node(s): "
                         "rdzv run is one agent per node and starts --nproc-per-node workers "
                         f"itself; start it with `{SRUN_HINT}`")
    node_name = env.get("SLURMD_NODENAME", "")
    derived = {
        "nnodes": Derived(nodes or "1", "Slurm: SLURM_STEP_NUM_NODES" if step is not None
                          else "Slurm: SLURM_JOB_NUM_NODES"),
        "node_order": Derived(env.get("SLURM_NODEID", "0"), "Slurm: SLURM_NODEID"),
        "last_call_timeout": Derived(f"{LAST_CALL:g}", "Slurm: srun starts the step's nodes "
                                     "together; later allocations join in-process"),
    }
    run_id = given.get("rdzv_id")
    if run_id is None:
        derived["rdzv_id"] = Derived(job_id, "Slurm: SLURM_JOB_ID")
        run_id = job_id
    backend = (given.get("rdzv_backend") or "tcp").lower()
    if given.get("rdzv_endpoint") is None and backend in ("tcp", "c10d"):
        derived.update(_endpoint(job_id, run_id, node_name, scontrol))
    if node_name:
        derived["local_addr"] = Derived(node_address(node_name, scontrol),
                                        f"Slurm: node {node_name}'s NodeAddr (scontrol)")
    return derived


def _endpoint(job_id: str, run_id: str, node_name: str, scontrol: Scontrol) -> dict[str, Derived]:
    """The run's store: the first node of the job the run id names (this one by default)."""
    if not run_id.isdigit():
        raise SlurmError(f"the run id {run_id!r} names no Slurm job, so its store is unknown: "
                         "give --rdzv-endpoint HOST:PORT too, or leave out --rdzv-id (the run "
                         "is then this job's) or name the job id of the run to join")
    if run_id == job_id:
        whose = "this job's"
    else:
        whose = f"job {run_id}'s"
        try:
            job = fields(scontrol(["show", "job", run_id, "--oneliner"]))
        except SlurmError as exc:
            raise SlurmError(f"--rdzv-id {run_id} names no Slurm job ({exc}); give the id of "
                             "the running job whose run to join, or --rdzv-endpoint") from None
        if job.get("JobState") != "RUNNING":
            raise SlurmError(f"--rdzv-id {run_id}: Slurm job {run_id} is "
                             f"{job.get('JobState', 'unknown')}, not running, so there is no "
                             "run to join; start the job first or give --rdzv-endpoint")
    first = first_node(run_id, scontrol)
    address = node_address(first, scontrol)
    host = f"[{address}]" if ":" in address else address
    return {
        "rdzv_endpoint": Derived(f"{host}:{job_port(run_id)}",
                                 f"Slurm: {whose} first node {first} (scontrol), port "
                                 f"{BASE_PORT} + job id % {PORTS}"),
        "is_host": Derived("1" if run_id == job_id and node_name == first else "0",
                           f"Slurm: the store is on {whose} first node {first}"),
    }


def first_node(job_id: str, scontrol: Scontrol) -> str:
    """The first node of a job's node list, as Slurm orders it."""
    node_list = fields(scontrol(["show", "job", job_id, "--oneliner"])).get("NodeList", "")
    names = scontrol(["show", "hostnames", node_list]).split() if node_list else []
    if not names:
        raise SlurmError(f"Slurm job {job_id} has no nodes yet; give --rdzv-endpoint HOST:PORT")
    return names[0]


def node_address(node_name: str, scontrol: Scontrol) -> str:
    """A node's address as Slurm knows it (``NodeAddr``; its name where Slurm has none)."""
    node = fields(scontrol(["show", "node", node_name, "--oneliner"]))
    return node.get("NodeAddr") or node_name
