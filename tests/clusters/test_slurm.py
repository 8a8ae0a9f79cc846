"""``rdzv run`` inside Slurm allocations of a real (loopback) Slurm cluster: no rendezvous flag
needed, what it derives shown and checked, and Slurm's own ways of ending and re-running jobs
(``scancel``, ``scancel --signal=KILL``, ``scontrol requeue``) met in-process."""

from __future__ import annotations

import json
import re
from pathlib import Path

from _slurmcluster import EXAMPLE, PRINT_RANK, ROOT, SBATCH_SCRIPT, Cluster
from _waiting import eventually

CONFIG_LINE = re.compile(r"^(\S+(?: \S+)?)\s{2,}(.*?)\s{2,}\((.*)\)$")


def config(path: Path) -> dict[str, tuple[str, str]]:
    """``rdzv run --print-config``'s lines: name -> (value, where it came from)."""
    rows = {}
    for line in path.read_text().splitlines():
        match = CONFIG_LINE.match(line)
        assert match, f"not a configuration line: {line!r}"
        rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def port(job: str) -> int:
    """The store port rdzv derives for a job (docs/clusters.md)."""
    return 27000 + int(job) % 2000


def progress(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_the_configuration_comes_from_the_allocation(cluster: Cluster, tmp_path: Path) -> None:
    for nodes in (1, 2, 3):
        out = tmp_path / f"n{nodes}"
        out.mkdir()
        job = cluster.sbatch(f"-N{nodes}", cwd=out, wait=True,
                             wrap=f"srun --ntasks-per-node=1 -o cfg-%n.txt rdzv run "
                                  f"--print-config {PRINT_RANK}")
        assert cluster.job(job)["ExitCode"] == "0:0"
        names = [f"n{i}" for i in range(1, nodes + 1)]
        for index, name in enumerate(names):
            rows = config(out / f"cfg-{index}.txt")
            assert rows["nnodes"] == (str(nodes), "Slurm: SLURM_STEP_NUM_NODES")
            assert rows["rdzv_id"] == (job, "Slurm: SLURM_JOB_ID")
            assert rows["rdzv_backend"] == ("tcp", "default")
            assert rows["rdzv_endpoint"] == (f"127.0.0.1:{port(job)}", "Slurm: this step's first "
                                             "node n1, port 27000 + job id % 2000")
            assert rows["rdzv_conf is_host"][0] == ("1" if index == 0 else "0")
            assert rows["rdzv_conf node_order"] == (str(index), "Slurm: SLURM_NODEID")
            assert rows["local_addr"] == ("127.0.0.1", f"Slurm: node {name}'s NodeAddr")

    # A step on some of the job's nodes: its own first node hosts the store.
    out = tmp_path / "part"
    out.mkdir()
    job = cluster.sbatch("-N3", cwd=out, wait=True, wrap=f"srun -N2 -r1 --ntasks-per-node=1 -o "
                         f"cfg-%n.txt rdzv run --print-config {PRINT_RANK}")
    first, second = config(out / "cfg-0.txt"), config(out / "cfg-1.txt")
    assert first["rdzv_endpoint"] == (f"127.0.0.1:{port(job)}", "Slurm: this step's first node "
                                      "n2, port 27000 + job id % 2000")
    assert (first["rdzv_conf is_host"][0], second["rdzv_conf is_host"][0]) == ("1", "0")
    assert first["local_addr"][1] == "Slurm: node n2's NodeAddr"
    assert first["nnodes"][0] == "2"

    # A range, and any other flag, is the user's: the flag wins over Slurm.
    out = tmp_path / "range"
    out.mkdir()
    cluster.sbatch("-N2", cwd=out, wait=True, wrap=f"srun --ntasks-per-node=1 -o cfg-%n.txt "
                   f"rdzv run --nnodes 1:3 --rdzv-conf last_call_timeout=5 --print-config "
                   f"{PRINT_RANK}")
    rows = config(out / "cfg-1.txt")
    assert rows["nnodes"] == ("1:3", "--nnodes")
    assert rows["rdzv_conf last_call_timeout"] == ("5", "--rdzv-conf")
    assert rows["rdzv_conf node_order"] == ("1", "Slurm: SLURM_NODEID")


def test_another_allocation_finds_the_run_it_names(cluster: Cluster, tmp_path: Path) -> None:
    first = cluster.sbatch("-N2", cwd=tmp_path, wrap="srun --ntasks-per-node=1 sleep 60")
    try:
        cluster.wait_state(first, ("RUNNING",), 30)
        cluster.sbatch("-N1", "-o", "second.txt", cwd=tmp_path, wait=True,
                       env={"PET_RDZV_ID": first},
                       wrap=f"srun rdzv run --nnodes 2:3 --print-config {PRINT_RANK}")
        rows = config(tmp_path / "second.txt")
        assert rows["rdzv_id"] == (first, "PET_RDZV_ID")
        assert rows["nnodes"] == ("2:3", "--nnodes")  # (the run's size: not this allocation's)
        assert rows["rdzv_endpoint"] == (f"127.0.0.1:{port(first)}",
                                         f"Slurm: job {first}'s first node n1, port 27000 + "
                                         "job id % 2000")
        assert rows["rdzv_conf is_host"] == ("0", f"Slurm: the store is on job {first}'s "
                                             "first node n1")
    finally:
        cluster.command("scancel", first)
    cluster.assert_no_processes(first)


def test_what_slurm_cannot_say_is_a_clear_error(cluster: Cluster, tmp_path: Path) -> None:
    cases = {
        # the batch script of a 2-node allocation instead of one srun task per node
        "batch": ("-N2", f"rdzv run {PRINT_RANK}",
                  "rdzv run: error: Slurm: this is the batch script of Slurm job {job}, which "
                  "has 2 nodes: start one rdzv run on each node with `srun --ntasks-per-node=1 "
                  "rdzv run ...`"),
        "tasks": ("-N1", f"srun --ntasks-per-node=2 rdzv run {PRINT_RANK}",
                  "rdzv run: error: Slurm: Slurm step {job}.0 runs 2 tasks on 1 node(s): rdzv "
                  "run is one agent per node and starts --nproc-per-node workers itself; start "
                  "it with `srun --ntasks-per-node=1 rdzv run ...`"),
        "no such job": ("-N1", f"srun rdzv run --rdzv-id 99999 --nnodes 2:3 {PRINT_RANK}",
                        "rdzv run: error: Slurm: --rdzv-id 99999 names no Slurm job"),
        "a name": ("-N1", f"srun rdzv run --rdzv-id myrun {PRINT_RANK}",
                   "rdzv run: error: Slurm: the run id 'myrun' names no Slurm job, so its "
                   "store is unknown: give --rdzv-endpoint HOST:PORT too"),
    }
    for name, (nodes, wrap, expected) in cases.items():
        out = tmp_path / f"{name.replace(' ', '-')}.txt"
        job = cluster.sbatch(nodes, "-o", str(out), cwd=tmp_path, wait=True, wrap=wrap)
        said = out.read_text()
        assert expected.format(job=job) in said, (name, said)
        assert "Traceback" not in said, name
        assert cluster.job(job)["ExitCode"] != "0:0", name


def test_a_job_trains_with_no_rendezvous_flag(cluster: Cluster, tmp_path: Path) -> None:
    """Two nodes, ``rdzv run train.py`` and nothing else: ranks follow Slurm's node order, the
    training runs to its end, the job exits 0."""
    job = cluster.sbatch("-N2", "-o", "job.txt", cwd=tmp_path, wait=True,
                         wrap=f"srun --ntasks-per-node=1 -o node-%n.txt rdzv run {EXAMPLE} "
                              "--steps 60 --step-sleep 0.02 --checkpoint ckpt --progress progress.jsonl "
                              "--log-every 1")
    fields = cluster.job(job)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), \
        (tmp_path / "node-0.txt").read_text()
    steps = progress(tmp_path / "progress.jsonl")
    assert [row["step"] for row in steps] == list(range(1, 61))
    assert {row["world_size"] for row in steps} == {2}
    first = (tmp_path / "node-0.txt").read_text()
    assert "this node is group rank 0 of 2" in first and "[0]:done: 60 steps" in first
    assert "this node is group rank 1 of 2" in (tmp_path / "node-1.txt").read_text()
    cluster.assert_no_processes(job)


def test_allocations_join_leave_requeue_and_die_in_process(cluster: Cluster,
                                                          tmp_path: Path) -> None:
    """``examples/slurm/train.sbatch`` as its comments say: a 2-node job; a 1-node allocation of
    the preemptible partition (``spot``) naming it joins in-process; preempted by a job of the
    higher partition, it leaves gracefully within its grace time, the script requeues it
    (``scontrol requeue``), and it comes back as a newcomer; ``scancel`` makes it leave
    gracefully; a node whose processes Slurm SIGKILLs is survived in-process; ``scancel`` of the
    first job ends everything at once."""
    path = tmp_path / "progress.jsonl"
    # (the example's own command, its training flags added after the script)
    train = [str(SBATCH_SCRIPT), "--steps", "100000", "--step-sleep", "0.05", "--checkpoint",
             str(tmp_path / "ckpt"), "--log-every", "1"]
    where = f"--chdir={ROOT}"  # (the script names examples/elastic_train.py from the clone)
    secret = {"RDZV_SECRET_FILE": str(tmp_path / "secret")}  # (made by the first job)
    main = cluster.sbatch("-N2", where, "-o", str(tmp_path / "main.txt"), cwd=tmp_path,
                          env=secret, script=[*train, "--progress", str(path)])
    jobs = [main]

    def world(size: int, after: int, what: str, within: float = 60) -> int:
        """The step at which rank 0 trains with ``size`` workers, after step ``after``."""
        return eventually(lambda: next((row["step"] for row in progress(path)
                                        if row["step"] > after and row["world_size"] == size),
                                       None), within, what)

    try:
        start = world(2, 5, "the 2-node job training")
        other = cluster.sbatch("-N1", "--partition=spot", where, "-o",
                               str(tmp_path / "other.txt"), cwd=tmp_path,
                               env={**secret, "PET_RDZV_ID": main}, script=train)
        jobs.append(other)
        joined = world(3, start, "the second allocation in the job")
        # a job of the higher partition needs a node: Slurm preempts the spot allocation, which
        # leaves gracefully within its grace time; the script requeues it (scontrol requeue)
        jobs.append(cluster.sbatch("-N1", "-o", "/dev/null", cwd=tmp_path, wrap="sleep 2"))
        preempted = world(2, joined, "the preempted allocation gone")
        # (a requeued job waits cred_expire-derived seconds, then the scheduler's next look)
        back = world(3, preempted, "the preempted allocation back as a newcomer", within=120)
        assert cluster.job(other)["Restarts"] == "1"
        cluster.command("scancel", other)
        cancelled = world(2, back, "the cancelled allocation gone")
        cluster.assert_no_processes(other)

        third = cluster.sbatch("-N1", where, "-o", str(tmp_path / "third.txt"), cwd=tmp_path,
                               env={**secret, "PET_RDZV_ID": main}, script=train)
        jobs.append(third)
        grown = world(3, cancelled, "the third allocation in the job")
        cluster.command("scancel", "--signal=KILL", f"{third}.0")  # its step's processes
        world(2, grown, "training on without the killed node")
        rows = progress(path)
    finally:
        for job in jobs:
            cluster.command("scancel", job)
    # scancel of the whole job: every node stops at once (the one hosting the store included),
    # well before Slurm's KillWait (30 s) would SIGKILL what is left.
    cluster.wait_state(main, ("CANCELLED",), 30)
    for job in jobs:
        cluster.assert_no_processes(job, within=10)

    steps = [row["step"] for row in rows]
    gaps = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
    # Joins, the requeue's and scancel's graceful leaves: not one step redone or skipped; the
    # SIGKILL: at most one redone.
    assert all(b == a for a, b in gaps) and len(gaps) <= 1, gaps
    main_out = (tmp_path / "main.txt").read_text()
    assert "restarting" not in main_out and "DIFFERENT" not in main_out, main_out
    assert main_out.count("(restart 0)") == 1  # rank 0 started once: no worker restarted
    assert "recovered in-process" in main_out
    other_out = (tmp_path / "other.txt").read_text()
    assert other_out.count("the workers joined the running group") == 2, other_out
    assert other_out.count("[2]:left the job after step") == 2, other_out
    third_out = (tmp_path / "third.txt").read_text()
    assert "the workers joined the running group" in third_out
