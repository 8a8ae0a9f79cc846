"""The agent's pure decisions and rank arithmetic (no processes)."""

from __future__ import annotations

from rdzv.agent._agent import worker_env
from rdzv.agent._grouprun import Action, on_membership_change, on_worker_exit
from rdzv.agent._config import LaunchConfig
from rdzv.agent._round import Assignment, all_done, mark_done, plan_assignments
from rdzv.rendezvous import RendezvousInfo
from rdzv.store import HashStore


def test_a_failure_restarts_until_the_budget_is_spent() -> None:
    assert on_worker_exit({0: 1, 1: None}, restarts=0, max_restarts=2) is Action.RESTART
    assert on_worker_exit({0: -9, 1: 0}, restarts=2, max_restarts=2) is Action.FAIL
    assert on_worker_exit({0: 0, 1: None}, restarts=0, max_restarts=0) is Action.CONTINUE
    assert on_worker_exit({0: 0, 1: 0}, restarts=0, max_restarts=0) is Action.SUCCEED


def test_membership_changes_reform_unless_the_run_is_closed() -> None:
    assert on_membership_change(closed=False, finished=False) is Action.REFORM
    assert on_membership_change(closed=False, finished=True) is Action.REFORM
    assert on_membership_change(closed=True, finished=False) is Action.CONTINUE
    assert on_membership_change(closed=True, finished=True) is Action.SUCCEED


def test_offsets_are_prefix_sums_also_per_role() -> None:
    plans = plan_assignments([(2, "trainer"), (4, "trainer"), (1, "evaluator"), (3, "trainer")])
    assert [p["offset"] for p in plans] == [0, 2, 6, 7]
    assert {p["world"] for p in plans} == {10}
    assert [p["role_offset"] for p in plans] == [0, 2, 0, 6]
    assert [p["role_world"] for p in plans] == [9, 9, 1, 9]


def test_worker_env_keeps_the_users_omp_setting() -> None:
    config = LaunchConfig(1, 1, 2, "tcp", "h:1", "job", {}, ("x",), role="r")
    assignment = Assignment(1, 3, 4, 12, 4, 12, "10.0.0.1", 1234)
    env = worker_env(config, assignment, 1, 2, {"OMP_NUM_THREADS": "8", "PATH": "/bin"})
    assert env["RANK"] == "5" and env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["ROLE_NAME"] == "r"
    assert env["OMP_NUM_THREADS"] == "8" and env["PATH"] == "/bin"
    assert worker_env(config, assignment, 0, 0, {})["OMP_NUM_THREADS"] == "1"


def test_a_node_marked_done_twice_still_waits_for_the_others() -> None:
    store = HashStore()
    first, second = RendezvousInfo(store, 0, 2), RendezvousInfo(store, 1, 2)
    mark_done(first)
    mark_done(first)  # two workers' exits reported the same success
    assert not all_done(first)
    mark_done(second)
    assert all_done(first) and all_done(second)
