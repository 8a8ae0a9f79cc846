"""``rdzv run``'s flags and PET_* env vars: what they configure, and clear errors (exit code 2)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from _agents import rdzv_cli

from rdzv.agent import ConfigError, add_run_arguments, config_from_args
from rdzv.agent._flags import parse_nnodes, parse_streams


def parse(argv: list[str], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_run_arguments(parser)
    return config_from_args(parser.parse_args(argv), env or {})


ELASTIC = ["--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "job"]


def test_torchrun_flags_in_both_spellings() -> None:
    config = parse(["--nnodes", "1:4", "--nproc_per_node", "3", "--max-restarts", "2",
                    "--rdzv_backend", "c10d", *ELASTIC, "--rdzv-conf",
                    "join_timeout=5,last_call_timeout=1", "--role", "trainer", "train.py",
                    "--lr", "0.1"])
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 4, 3)
    assert config.rdzv_backend == "tcp"  # torch's c10d is an alias
    assert config.rdzv_conf == {"join_timeout": "5", "last_call_timeout": "1"}
    assert config.max_restarts == 2 and config.role == "trainer"
    assert config.command == (sys.executable, "-u", "train.py", "--lr", "0.1")


def test_module_and_no_python() -> None:
    assert parse([*ELASTIC, "-m", "pkg.train", "x"]).command == (sys.executable, "-u", "-m",
                                                                  "pkg.train", "x")
    assert parse([*ELASTIC, "--no-python", "echo", "hi"]).command == ("echo", "hi")


def test_env_vars_stand_for_missing_flags_and_flags_win() -> None:
    env = {"PET_NNODES": "2:3", "PET_NPROC_PER_NODE": "4", "PET_RDZV_ENDPOINT": "h:1",
           "PET_RDZV_ID": "from-env", "PET_STANDALONE": "0", "PET_MAX_RESTARTS": "5"}
    config = parse(["--max-restarts", "1", "train.py"], env)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 3, 4)
    assert (config.rdzv_endpoint, config.run_id, config.max_restarts) == ("h:1", "from-env", 1)


@pytest.mark.parametrize(
    "endpoint, expected",
    [("", "localhost:29400"), ("  ", "localhost:29400"), ("node-0", "node-0:29400"),
     ("10.0.0.1:1234", "10.0.0.1:1234"), ("[::1]", "[::1]:29400"), ("[::1]:5", "[::1]:5")],
)
def test_tcp_endpoint_defaults_as_torchs_c10d(endpoint: str, expected: str) -> None:
    """torchrun's --rdzv-endpoint defaults to empty, which torch's c10d takes as
    localhost:29400 (a missing port as 29400): so does `rdzv run`."""
    config = parse(["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "train.py"])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("tcp", expected)
    assert parse(["train.py"]).rdzv_endpoint == "localhost:29400"


def test_standalone_needs_nothing_else() -> None:
    config = parse(["--standalone", "--nproc-per-node", "2", "train.py"])
    assert config.standalone and config.rdzv_backend == "tcp"
    assert config.rdzv_endpoint == "127.0.0.1:0" and config.max_nodes == 1


def test_master_flags_make_a_static_job() -> None:
    config = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                    "--master-port", "1234", "train.py"])
    assert config.rdzv_backend == "static" and config.rdzv_endpoint == "10.0.0.1:1234"
    assert config.rdzv_conf == {"rank": "1", "world_size": "2"} and config.node_rank == 1


def test_redirects_and_tee_per_rank() -> None:
    choice = parse_streams("0:1,1:3", "--tee")
    assert choice.streams(0) == {"stdout"} and choice.streams(1) == {"stdout", "stderr"}
    assert choice.streams(2) == frozenset()
    assert parse_streams("2", "-r").streams(7) == {"stderr"}


@pytest.mark.parametrize(
    ("argv", "env", "flag", "hint"),
    [
        (["--nnodes", "4:2", *ELASTIC], {}, "--nnodes", "MIN <= MAX"),
        (["--nnodes", "two", *ELASTIC], {}, "--nnodes", "--nnodes 2 or --nnodes 1:4"),
        (["--nnodes", "0", *ELASTIC], {}, "--nnodes", "must be >= 1"),
        ([*ELASTIC], {"PET_NNODES": "x"}, "PET_NNODES", "not an integer"),
        (["--nproc-per-node", "0", *ELASTIC], {}, "--nproc-per-node", ">= 1"),
        (["--nproc-per-node", "many", *ELASTIC], {}, "--nproc-per-node", "auto, cpu or gpu"),
        (["--max-restarts", "-1", *ELASTIC], {}, "--max-restarts", ">= 0"),
        (["--monitor-interval", "0", *ELASTIC], {}, "--monitor-interval", ">="),
        (["--worker-connect-timeout", "-1", *ELASTIC], {}, "--worker-connect-timeout",
         "must be >= 0, got '-1'; e.g. --worker-connect-timeout 30"),
        ([*ELASTIC], {"PET_WORKER_CONNECT_TIMEOUT": "soon"}, "PET_WORKER_CONNECT_TIMEOUT",
         "'soon' is not a number"),
        (["--rdzv-conf", "join_timeout", *ELASTIC], {}, "--rdzv-conf", "key=value"),
        (["--redirects", "5", *ELASTIC], {}, "--redirects", "0 (none)"),
        (["--standalone", "--rdzv-endpoint", "h:1"], {}, "--standalone", "--rdzv-endpoint"),
        (["--standalone", "--nnodes", "2"], {}, "--standalone", "drop one"),
        (["--master-addr", "h", "--rdzv-backend", "tcp", *ELASTIC], {}, "--master-addr",
         "static jobs"),
        (["--nnodes", "1:2", "--node-rank", "0"], {}, "--nnodes", "fixed size"),
        (["--nnodes", "2", "--node-rank", "2"], {}, "--node-rank", "0..1"),
        (["--rdzv-backend", "etcd"], {}, "--rdzv-endpoint", "needs an endpoint"),
        (["--rdzv-endpoint", "~", "--rdzv-id", "j"], {}, "--rdzv-endpoint",
         "The hostname of the rendezvous endpoint '~' must be a dot-separated list of labels"),
        (["--rdzv-endpoint", "dummy.com :123"], {}, "--rdzv-endpoint", "The hostname of"),
        (["--rdzv-endpoint", ":29400"], {}, "--rdzv-endpoint", "The hostname of"),
        (["--rdzv-endpoint", "host:"], {}, "--rdzv-endpoint",
         "The port number of the rendezvous endpoint 'host:' must be an integer"),
        (["--rdzv-endpoint", "host:65536"], {}, "--rdzv-endpoint", "The port number of"),
        ([], {"PET_RDZV_ENDPOINT": "a b:1"}, "PET_RDZV_ENDPOINT", "The hostname of"),
        (["--rdzv-conf", "a=1,,c=2", *ELASTIC], {}, "--rdzv-conf",
         "The rendezvous configuration string must be in format <key1>=<value1>"),
        (["--rdzv-conf", "join_timeout=", *ELASTIC], {}, "--rdzv-conf",
         "The rendezvous configuration option 'join_timeout' must have a value specified"),
        (["--rdzv-conf", "=5", *ELASTIC], {}, "--rdzv-conf", "must be in format"),
        (["-m", "--no-python", *ELASTIC], {}, "-m/--no-python/--run-path", "at most one"),
        (["--role", "a b", *ELASTIC], {}, "--role", "not a role name"),
        ([*ELASTIC], {"PET_STANDALONE": "maybe"}, "PET_STANDALONE", "1 or 0"),
    ],
)
def test_bad_flags_name_the_flag_and_the_fix(argv: list[str], env: dict[str, str], flag: str,
                                             hint: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse([*argv, "train.py"], env)
    assert caught.value.flag == flag
    assert hint in str(caught.value)


def test_parse_nnodes() -> None:
    assert parse_nnodes("3") == (3, 3) and parse_nnodes("1:8") == (1, 8)
    with pytest.raises(ConfigError, match="no maximum"):
        parse_nnodes("2:")


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return rdzv_cli(*argv, module="rdzv.run", timeout=60)


def test_cli_bad_flag_exits_2_with_the_fix() -> None:
    result = run_cli("--nnodes", "3:1", "--standalone", "x.py")
    assert result.returncode == 2
    assert "--nnodes: the maximum 1 is below the minimum 3" in result.stderr


def test_cli_missing_script_exits_2() -> None:
    result = run_cli("--standalone", "no/such/script.py")
    assert result.returncode == 2 and "no/such/script.py' does not exist" in result.stderr


def test_cli_unknown_rdzv_option_exits_2() -> None:
    result = run_cli("--standalone", "--rdzv-conf", "join_timout=1", __file__)
    assert result.returncode == 2 and "Did you mean 'join_timeout'" in result.stderr


SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "3",
              "SLURM_STEP_NUM_TASKS": "3", "SLURM_NODEID": "2", "SLURMD_NODENAME": "node7",
              "SLURM_STEP_NODELIST": "node[5-7]", "PATH": "/nonexistent"}
"""A Slurm step's environment, on a node without Slurm's commands (a container, say): what the
flags make unnecessary is never asked of scontrol. (The real-cluster tests in tests/clusters
cover what scontrol says.)"""
GIVEN = ["--rdzv-backend", "etcd", "--rdzv-endpoint", "10.0.0.1:2379", "--local-addr", "10.0.0.7"]


def test_slurm_fills_what_no_flag_gives_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # (no scontrol to run)
    config = parse([*GIVEN, "train.py"], SLURM_STEP)
    assert (config.min_nodes, config.max_nodes, config.run_id) == (3, 3, "4242")
    assert config.rdzv_conf == {"node_order": "2", "last_call_timeout": "2"}
    assert config.origins["nnodes"] == "Slurm: SLURM_STEP_NUM_NODES"
    assert config.origins["rdzv_id"] == "Slurm: SLURM_JOB_ID"
    assert config.origins["rdzv_conf:node_order"] == "Slurm: SLURM_NODEID"
    given = parse([*GIVEN, "--nnodes", "2:4", "--rdzv-conf", "node_order=7", "train.py"],
                  {**SLURM_STEP, "PET_RDZV_ID": "mine"})
    assert (given.min_nodes, given.max_nodes, given.run_id) == (2, 4, "mine")
    assert given.rdzv_conf["node_order"] == "7"
    assert given.origins["rdzv_conf:node_order"] == "--rdzv-conf"
    assert given.origins["rdzv_id"] == "PET_RDZV_ID"
    # what only scontrol knows, asked of a node without it: the error names the flags to give
    with pytest.raises(ConfigError, match=r"Slurm: scontrol is not on PATH \(a container without "
                       r"Slurm's commands\?\); give --rdzv-endpoint HOST:PORT and --local-addr "
                       r"ADDRESS"):
        parse(["train.py"], SLURM_STEP)
    # joining another job's run: its size is not this allocation's
    with pytest.raises(ConfigError, match="--rdzv-id 17 joins the run of another job: give that "
                                          "run's --nnodes MIN:MAX too"):
        parse([*GIVEN, "--rdzv-id", "17", "train.py"], SLURM_STEP)
    # a shell of the allocation that is not on one of its nodes
    with pytest.raises(ConfigError, match="not on one of its nodes"):
        parse([*GIVEN, "train.py"], {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2"})


def test_standalone_and_static_jobs_take_nothing_from_slurm() -> None:
    standalone = parse(["--standalone", "train.py"], SLURM_STEP)
    assert standalone.max_nodes == 1 and "node_order" not in standalone.rdzv_conf
    static = parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                    "train.py"], SLURM_STEP)
    assert static.rdzv_backend == "static" and static.run_id == "static"
    assert static.origins["rdzv_conf:rank"] == "static job: --node-rank, --nnodes"


def test_a_kubernetes_indexed_job_orders_the_nodes_by_pod_index() -> None:
    config = parse([*ELASTIC, "train.py"], {"JOB_COMPLETION_INDEX": "3"})
    assert config.rdzv_conf == {"node_order": "3"}
    assert config.origins["rdzv_conf:node_order"] == "Kubernetes: JOB_COMPLETION_INDEX"


def test_print_config_shows_each_value_and_its_origin() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rdzv", "run", "--print-config", "--nnodes", "1:4", "--rdzv-id",
         "job", "--rdzv-conf", "join_timeout=5", "no/such/script.py"],
        env={"PATH": "/usr/bin:/bin", "PET_NPROC_PER_NODE": "2"}, capture_output=True,
        text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    rows = [" ".join(line.split()) for line in done.stdout.splitlines()]
    assert rows[:6] == ["nnodes 1:4 (--nnodes)", "nproc_per_node 2 (PET_NPROC_PER_NODE)",
                        "rdzv_backend tcp (default)", "rdzv_endpoint localhost:29400 (default)",
                        "rdzv_id job (--rdzv-id)",
                        "local_addr (this machine's name) (default)"]
    assert rows[6] == "rdzv_conf join_timeout 5 (--rdzv-conf)"
    assert rows[7].startswith("command ")
    assert rows[7].endswith("no/such/script.py (TRAINING_SCRIPT)")
    preloading = subprocess.run(
        [sys.executable, "-m", "rdzv", "run", "--print-config", "--standalone", "train.py"],
        env={"PATH": "/usr/bin:/bin", "PET_PRELOAD": "torch,numpy"}, capture_output=True,
        text=True, timeout=60, check=False)
    assert preloading.returncode == 0, preloading.stderr
    assert "preload torch,numpy (PET_PRELOAD)" in [
        " ".join(line.split()) for line in preloading.stdout.splitlines()]
