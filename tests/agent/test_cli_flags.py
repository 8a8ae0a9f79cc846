"""Unknown and misspelt flags of ``rdzv run``/``serve``/``status``: exit code 2, what is wrong,
and the flag that was meant, as a user sees them on the console."""

from __future__ import annotations

import pytest

from _agents import rdzv_cli
from rdzv.cli._hints import flags_meant

RUN_FLAGS = ["--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend",
             "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-conf", "--standalone"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "--nproc-per-nod", "2", "x.py"],
         "rdzv run: error: unrecognized arguments: --nproc-per-nod; "
         "did you mean --nproc-per-node?"),
        (["run", "--rdzv-backnd", "tcp", "x.py"],
         "unrecognized arguments: --rdzv-backnd; did you mean --rdzv-backend?"),
        (["run", "--nproc_per_nod=2", "x.py"], "did you mean --nproc_per_node?"),
        (["run", "-nnodes", "2", "x.py"], "did you mean --nnodes?"),
        (["run", "--standalone", "--epochs", "3", "x.py"],
         "unrecognized arguments: --epochs; arguments of the training script go after "
         "TRAINING_SCRIPT"),
        (["serve", "--prot", "0"], "rdzv serve: error: unrecognized arguments: --prot 0; "
                                   "did you mean --port?"),
        (["serve", "--data-dri", "/tmp/x"], "did you mean --data-dir?"),
        (["status", "--jsn", "tcp://127.0.0.1:1/job"],
         "rdzv status: error: unrecognized arguments: --jsn; did you mean --json?"),
        (["status", "--rdzv-endpont", "h:1", "--rdzv-id", "job"],
         "did you mean --rdzv-endpoint?"),
    ],
)
def test_a_misspelt_flag_names_the_flag_meant_and_exits_2(argv: list[str], said: str) -> None:
    result = rdzv_cli(*argv, timeout=60)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert result.stderr.startswith(f"usage: rdzv {argv[0]} ")  # the sub-command's usage
    assert result.stdout == ""


def test_python_dash_m_entry_points_give_the_same_hints() -> None:
    run = rdzv_cli("--nproc-per-nod", "2", "x.py", module="rdzv.run", timeout=60)
    assert run.returncode == 2
    assert ("python -m rdzv.run: error: unrecognized arguments: --nproc-per-nod; "
            "did you mean --nproc-per-node?") in run.stderr
    serve = rdzv_cli("serve", "--prot", "0", module="rdzv", timeout=60)
    assert serve.returncode == 2
    assert ("rdzv serve: error: unrecognized arguments: --prot 0; "
            "did you mean --port?") in serve.stderr


def test_several_unknown_flags_each_get_their_hint() -> None:
    result = rdzv_cli("run", "--nnode=2", "--rdzv-backnd=tcp", "--standalone", "x.py",
                      timeout=60)
    assert result.returncode == 2
    assert ("unrecognized arguments: --nnode=2 --rdzv-backnd=tcp; did you mean --nnodes for "
            "--nnode, --rdzv-backend for --rdzv-backnd?") in result.stderr


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("--nproc-per-nod", ["--nproc-per-node"]),
        ("--nproc_per_nod", ["--nproc_per_node"]),  # the spelling the user chose
        ("--nproc", ["--nproc-per-node"]),  # torchrun's flags are not abbreviated
        ("--nprocs", ["--nproc-per-node"]),
        ("--nproc-per_node", ["--nproc-per-node"]),
        ("-standalone", ["--standalone"]),
        ("--rdzv", ["--rdzv-backend", "--rdzv-conf", "--rdzv-endpoint"]),
        ("--rdzv-endpont", ["--rdzv-endpoint"]),
        ("--epochs", []),
        ("-x", []),
    ],
)
def test_flags_meant(typed: str, meant: list[str]) -> None:
    assert flags_meant(typed, RUN_FLAGS) == meant
