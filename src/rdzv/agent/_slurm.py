"""What ``rdzv run`` takes from Slurm when it runs in a job step, so that it needs no flag.

Inside a job step (``srun ... rdzv run train.py``), each value the user did not give (by flag or
``PET_*`` env var) comes from Slurm:

* the run id is the job id (``SLURM_JOB_ID``): every node of the step shares it, a requeued job
  keeps it, and another allocation joins the run by naming it (``--rdzv-id JOBID``, with the
  run's ``--nnodes``);
* the number of nodes is the step's (``SLURM_STEP_NUM_NODES``), fixed; give ``--nnodes MIN:MAX``
  for a job that other allocations may grow;
* the endpoint (tcp backend) is the step's first node, by its address as Slurm knows it
  (``NodeAddr``), on port :func:`job_port` (one port per job, so that jobs sharing a first node
  do not share a store); that node hosts the store (``is_host``), the others connect. A run id
  naming another running job points at that job's first node (the first node of its step, when
  the step spans the job, as ``srun`` in a batch script does);
* this node's address (``--local-addr``) is its ``NodeAddr``;
* the node order: newcomers of a round are ranked by their node index in the step
  (``SLURM_NODEID``, the rendezvous option ``node_order``);
* the last call (``last_call_timeout``) is 2 s: ``srun`` starts every node of the step at once,
  so a job of ``--nnodes 2:4`` on 2 nodes starts training at once, not 30 s later.

It asks Slurm's controller only what the environment does not say, and once: ``scontrol show
hostnames`` expands the step's node list locally, one ``scontrol show node`` gives the addresses
(a node given ``--rdzv-endpoint`` and ``--local-addr`` asks nothing). What Slurm cannot say is a
:class:`SlurmError` naming the flag to give: the batch script of a multi-node allocation, a shell
that is not on a node of the allocation (``salloc`` on a login node), several tasks per node, a
heterogeneous job, a run id that names no running job.
"""

from __future__ import annotations

import logging
import subprocess
from typing import Callable, Mapping, Sequence

from ..rendezvous import canonical_backend

logger = logging.getLogger(__name__)

BASE_PORT = 27000
PORTS = 2000
"""A job's store port is ``BASE_PORT + job id % PORTS``: below the ephemeral ports, clear of
torch's defaults (29400, 29500)."""
LAST_CALL = 2.0
SCONTROL_TIMEOUT = 10.0
SRUN_HINT = "srun --ntasks-per-node=1 rdzv run ..."

Derived = tuple[str, str]
"""A value taken from where ``rdzv run`` runs, as a flag would give it, and its origin."""
Scontrol = Callable[[Sequence[str]], str]
"""Runs ``scontrol ARGS`` and returns its output (raises :class:`SlurmError`)."""


class SlurmError(ValueError):
    """Slurm's environment or ``scontrol`` cannot give what ``rdzv run`` needs; says the fix."""


class ScontrolFailed(SlurmError):
    """``scontrol`` could not be run or failed (the caller adds the flags that replace it)."""


def job_port(job_id: str) -> int:
    """The store port of a job's run (see :data:`PORTS`)."""
    return BASE_PORT + int(job_id) % PORTS


def run_scontrol(args: Sequence[str]) -> str:
    """``scontrol ARGS``'s output; a :class:`SlurmError` saying what failed otherwise."""
    command = ["scontrol", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT,
                              check=False)
    except FileNotFoundError:
        raise ScontrolFailed("scontrol is not on PATH (a container without Slurm's commands?)") \
            from None
    except subprocess.TimeoutExpired:
        raise ScontrolFailed(f"`{' '.join(command)}` did not answer within {SCONTROL_TIMEOUT:g} s "
                         "(is slurmctld up?)") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        said = lines[-1].strip() if lines else f"exit code {done.returncode}"
        raise ScontrolFailed(f"`{' '.join(command)}` failed ({said})")
    return done.stdout


def records(text: str) -> list[dict[str, str]]:
    """The ``Key=Value`` records of ``scontrol show ... --oneliner``, one per line."""
    found = []
    for line in text.splitlines():
        pairs = (word.partition("=") for word in line.split())
        record = {key: value for key, sep, value in pairs if sep}
        if record:
            found.append(record)
    return found


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def derive(env: Mapping[str, str], given: Mapping[str, str | None],
           scontrol: Scontrol = run_scontrol) -> dict[str, Derived]:
    """The values ``rdzv run`` takes from Slurm, by flag name (``nnodes``, ``rdzv_id``,
    ``rdzv_endpoint``, ``local_addr``) and rendezvous option (``is_host``, ``node_order``,
    ``last_call_timeout``).

    ``given`` holds what the user gave for those flags and ``rdzv_backend`` (None: not given).
    Raises :class:`SlurmError` where Slurm cannot say and a flag must.
    """
    job_id = env["SLURM_JOB_ID"]
    node_name = env.get("SLURMD_NODENAME", "")
    step = env.get("SLURM_STEP_ID")
    if step is None:
        nodes, node_list = env.get("SLURM_JOB_NUM_NODES", "1"), env.get("SLURM_JOB_NODELIST", "")
    else:
        nodes, node_list = env.get("SLURM_STEP_NUM_NODES", "1"), env.get("SLURM_STEP_NODELIST", "")
    _check_place(env, job_id, node_name, step, nodes)
    derived: dict[str, Derived] = {
        "node_order": (env.get("SLURM_NODEID", "0"), "Slurm: SLURM_NODEID"),
        "last_call_timeout": (f"{LAST_CALL:g}", "Slurm: srun starts the step's nodes together; "
                                                "later allocations join in-process"),
    }
    run_id = given.get("rdzv_id")
    joining = run_id is not None and run_id != job_id  # another job's run, or a named one
    need_endpoint = given.get("rdzv_endpoint") is None and \
        canonical_backend(given.get("rdzv_backend") or "tcp") == "tcp"
    if joining and need_endpoint and not run_id.isdigit():  # type: ignore[union-attr]
        raise SlurmError(f"the run id {run_id!r} names no Slurm job, so its store is unknown: "
                         "give --rdzv-endpoint HOST:PORT too, or leave out --rdzv-id (the run "
                         "is then this job's), or name the job id of the run to join")
    if given.get("nnodes") is None:
        if joining and run_id.isdigit():  # type: ignore[union-attr]
            raise SlurmError(f"--rdzv-id {run_id} joins the run of another job: give that run's "
                             f"--nnodes MIN:MAX too (this allocation's {nodes} node(s) are not "
                             "its size)")
        derived["nnodes"] = (nodes, "Slurm: SLURM_STEP_NUM_NODES" if step is not None
                             else "Slurm: SLURM_JOB_NUM_NODES")
    if run_id is None:
        derived["rdzv_id"] = (job_id, "Slurm: SLURM_JOB_ID")
        run_id = job_id
    need_address = given.get("local_addr") is None
    if need_endpoint and env.get("SLURM_HET_SIZE"):
        raise SlurmError("a heterogeneous job has no one first node for the store: give "
                         "--rdzv-endpoint HOST:PORT")
    first, addresses = "", {}
    try:
        if need_endpoint:
            first = _first_of_job(run_id, scontrol) if joining else _first_of(node_list, scontrol)
        wanted = [first] * need_endpoint + [node_name] * need_address
        addresses = node_addresses(wanted, scontrol) if wanted else {}
    except ScontrolFailed as exc:
        flags = (["--rdzv-endpoint HOST:PORT"] * need_endpoint
                 + ["--local-addr ADDRESS"] * need_address)
        raise SlurmError(f"{exc}; give {' and '.join(flags)}") from None
    if first:
        address = addresses[first]
        host = f"[{address}]" if ":" in address else address
        whose = f"job {run_id}'s" if joining else "this step's"
        derived["rdzv_endpoint"] = (f"{host}:{job_port(run_id)}",
                                    f"Slurm: {whose} first node {first}, port {BASE_PORT} + "
                                    f"job id % {PORTS}")
        derived["is_host"] = ("1" if not joining and node_name == first else "0",
                              f"Slurm: the store is on {whose} first node {first}")
    if need_address:
        derived["local_addr"] = (addresses[node_name], f"Slurm: node {node_name}'s NodeAddr")
    return derived


def _check_place(env: Mapping[str, str], job_id: str, node_name: str, step: str | None,
                 nodes: str) -> None:
    """rdzv run is one agent per node of a step (or the batch script of a 1-node job)."""
    if not node_name:
        raise SlurmError(f"this shell is in Slurm job {job_id} but not on one of its nodes (a "
                         f"login node, an salloc shell?): start rdzv run on the job's nodes "
                         f"with `{SRUN_HINT}`")
    if step is None and nodes != "1":
        raise SlurmError(f"this is the batch script of Slurm job {job_id}, which has {nodes} "
                         f"nodes: start one rdzv run on each node with `{SRUN_HINT}`")
    tasks = env.get("SLURM_STEP_NUM_TASKS")
    if step is not None and tasks is not None and tasks != nodes:
        raise SlurmError(f"Slurm step {job_id}.{step} runs {tasks} tasks on {nodes} node(s): "
                         "rdzv run is one agent per node and starts --nproc-per-node workers "
                         f"itself; start it with `{SRUN_HINT}`")


def _first_of(node_list: str, scontrol: Scontrol) -> str:
    """The first host of a node list expression (expanded locally by scontrol)."""
    names = scontrol(["show", "hostnames", node_list]).split() if node_list else []
    if not names:
        raise SlurmError("Slurm gives no node list for this step: give --rdzv-endpoint HOST:PORT")
    return names[0]


def _first_of_job(job_id: str, scontrol: Scontrol) -> str:
    """The first node of another running job, the one whose run is joined."""
    try:
        found = records(scontrol(["show", "job", job_id, "--oneliner"]))
    except ScontrolFailed as exc:
        raise SlurmError(f"--rdzv-id {job_id} names no Slurm job ({exc}); give the id of the "
                         "running job whose run to join, or --rdzv-endpoint HOST:PORT") from None
    job = next((record for record in found if record.get("JobId") == job_id), {})
    if job.get("JobState") != "RUNNING":
        raise SlurmError(f"--rdzv-id {job_id}: Slurm job {job_id} is "
                         f"{job.get('JobState', 'unknown')}, not running, so there is no run to "
                         "join; start that job first or give --rdzv-endpoint HOST:PORT")
    return _first_of(job.get("NodeList", ""), scontrol)


def node_addresses(names: Sequence[str], scontrol: Scontrol) -> dict[str, str]:
    """Each node's address as Slurm knows it (``NodeAddr``; its name where Slurm has none),
    from one ``scontrol show node``."""
    unique = list(dict.fromkeys(names))
    found = records(scontrol(["show", "node", ",".join(unique), "--oneliner"]))
    known = {record.get("NodeName", ""): record.get("NodeAddr", "") for record in found}
    return {name: known.get(name) or name for name in unique}
