"""The agent's worker environment and finish bookkeeping (no processes)."""

from __future__ import annotations

from rdzv.agent._agent import worker_env
from rdzv.agent._config import LaunchConfig
from rdzv.agent._records import Assignment
from rdzv.agent._round import all_done, mark_done
from rdzv.rendezvous import RendezvousInfo
from rdzv.store import HashStore


def test_worker_env_keeps_the_users_omp_setting() -> None:
    config = LaunchConfig(1, 1, 2, "tcp", "h:1", "job", {}, ("x",), role="r")
    assignment = Assignment(1, 3, 4, 12, 4, 12, "10.0.0.1", 1234, (0, 1))
    env = worker_env(config, assignment, 1, 2, {"OMP_NUM_THREADS": "8", "PATH": "/bin"})
    assert env["RANK"] == "5" and env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "1"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "1234"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["ROLE_NAME"] == "r"
    assert env["OMP_NUM_THREADS"] == "8" and env["PATH"] == "/bin"
    assert worker_env(config, assignment, 0, 0, {})["OMP_NUM_THREADS"] == "1"


def test_a_worker_started_to_join_takes_its_ranks_from_its_plan() -> None:
    config = LaunchConfig(1, 1, 1, "tcp", "h:1", "job", {}, ("x",))
    env = worker_env(config, None, 0, 1, {"RANK": "3", "MASTER_PORT": "9", "PATH": "/bin"})
    assert env["RDZV_INPROCESS_JOIN"] == "1" and env["LOCAL_RANK"] == "0"
    assert "RANK" not in env and "MASTER_PORT" not in env and env["PATH"] == "/bin"
    assert "RDZV_JOIN_STORE" not in env  # (alone: it waits for the switch in init_process_group)
    together = worker_env(config, None, 0, 1, {"RDZV_JOIN_STORE": "/old"}, "/logs/join.store")
    assert together["RDZV_JOIN_STORE"] == "/logs/join.store"  # its node's provisional group
    assert "RDZV_JOIN_STORE" not in worker_env(config, None, 0, 1, {"RDZV_JOIN_STORE": "/old"})


def test_a_node_marked_done_twice_still_waits_for_the_others() -> None:
    store = HashStore()
    first, second = RendezvousInfo(store, 0, 2), RendezvousInfo(store, 1, 2)
    mark_done(first)
    mark_done(first)  # two workers' exits reported the same success
    assert not all_done(first)
    mark_done(second)
    assert all_done(first) and all_done(second)
