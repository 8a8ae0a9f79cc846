"""A run's history on real runs (tcp with ``rdzv serve``, etcd, file): joins, a graceful leave,
a worker failure and a SIGKILLed node produce the expected events in order, as ``rdzv status
--events`` (and ``--json``) prints them; ``--follow`` prints them as they come and ends with the
run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from _agents import JOIN, WORKER, rdzv_cli, wait_for
from _launcher import PYTHON, RDZV_RUN, Launcher, free_port

from rdzv.rendezvous import RunEvent, read_events
from rdzv.rendezvous._status import open_store
from rdzv.rendezvous import parse_rendezvous_url

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "etcd"))
from etcd_testing import etcd_params, require_etcd  # noqa: E402

from rdzv.etcd import LocalEtcd  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # real processes: slow on a loaded machine

SETTINGS = "last_call_timeout=1,heartbeat_interval=1,heartbeat_misses=5"
"""A 5 s session ttl: a loaded machine does not stall a live agent that long; a SIGKILLed node
on etcd is dropped when its lease runs out."""


@pytest.fixture(params=["tcp", "etcd", "file"])
def backend(request: Any, tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """(backend, endpoint, extra rdzv-conf) of a store that outlives the agents."""
    name = request.param
    if name == "tcp":
        port = free_port()
        servers = Launcher(tmp_path, "server")
        server = servers.start([PYTHON, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                                "--port", str(port)])
        wait_for(lambda: "listening on" in server.output(), JOIN, "the store server")
        yield name, f"127.0.0.1:{port}", ",is_host=0"
        servers.kill_all()
    elif name == "etcd":
        binary = require_etcd(etcd_params()[0].values[0])
        with LocalEtcd(binary=binary) as server:
            yield name, server.endpoint, ""
    else:
        (tmp_path / "rdzv").mkdir()
        yield name, str(tmp_path / "rdzv"), ""


def events_of(backend: tuple[str, str, str]) -> Callable[[], list[RunEvent]]:
    name, endpoint, _ = backend
    params = parse_rendezvous_url(f"{name}://{endpoint}/job?nnodes=1" if name != "file"
                                  else f"file://{endpoint}/job?nnodes=1")

    def read() -> list[RunEvent]:
        store = open_store(params)
        try:
            return read_events(store, "job").events
        finally:
            store.close()
    return read


def cli(backend: tuple[str, str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    name, endpoint, _ = backend
    return rdzv_cli("status", "--rdzv-backend", name, "--rdzv-endpoint", endpoint,
                    "--rdzv-id", "job", "--events", *extra)


def test_history_of_joins_a_leave_a_failure_and_a_loss(backend: Any, tmp_path: Path) -> None:
    name, endpoint, conf = backend
    out = tmp_path / "out"
    out.mkdir()
    args = ["--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "3",
            "--rdzv-backend", name, "--rdzv-endpoint", endpoint, "--rdzv-id", "job",
            "--rdzv-conf", SETTINGS + conf, "--local-addr", "127.0.0.1",
            "--log-dir", str(tmp_path / "logs"), "--stop-timeout", "5",
            "--worker-connect-timeout", "1",  # (the worker does not use the in-process API)
            "--no-python", PYTHON, WORKER, str(out), "--until", str(out / "stop"),
            "--fail-rank", "1", "--fail-when", str(out / "fail-rank-1")]
    agents = Launcher(tmp_path, "agent")
    args = [*RDZV_RUN, *args]
    history = events_of(backend)

    def formed(world_size: int, after: int = -1) -> RunEvent:
        return wait_for(lambda: next((e for e in history() if e.kind == "round_formed"
                                      and e.round is not None and e.round > after
                                      and e.fields["world_size"] == world_size), None),
                        JOIN, f"a round of {world_size} after round {after}")

    follow = subprocess.Popen(
        [PYTHON, "-m", "rdzv", "status", "--rdzv-backend", name, "--rdzv-endpoint", endpoint,
         "--rdzv-id", "job", "--events", "--follow", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        agents.start(args)
        agents.start(args)
        first = formed(2)
        c = agents.start(args)
        joined = formed(3, first.round)
        assert joined.fields["cause"] == "join"
        wait_for(lambda: sum(e.kind == "workers_started" and e.round == joined.round
                             for e in history()) == 3, JOIN, "the workers of the round of 3")
        c.signal(signal.SIGTERM)  # a graceful leave
        assert c.wait() == 0
        after_leave = formed(2, joined.round)
        # a worker fails once: its node restarts, with the others, in a new round
        wait_for(lambda: sum(e.kind == "workers_started" and e.round == after_leave.round
                             for e in history()) == 2, JOIN,
                 "the workers of the round without the leaver")
        (out / "fail-rank-1").touch()
        restarted = formed(2, after_leave.round)
        d = agents.start(args)
        grown = formed(3, restarted.round)
        wait_for(lambda: sum(e.kind == "workers_started" and e.round == grown.round
                             for e in history()) == 3, JOIN, "the workers of the round of 3")
        d.kill()  # SIGKILL, its workers too
        shrunk = formed(2, grown.round)
        (out / "stop").touch()
        for agent in agents.started[:2]:
            assert agent.wait() == 0, agent.output()[-3000:]
        followed, errors = follow.communicate(timeout=120)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
        agents.kill_all()
    assert follow.returncode == 0, errors

    result = cli(backend, "--json")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(set(r) == {"seq", "time", "kind", "round", "node", "fields"} for r in records)
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)
    # --follow printed the history as it came, each event once, and stopped when the run
    # closed; an event written in the background may come after a newer one, and one written
    # well after the close (a last flush) may come after it stopped
    def ident(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["seq"], r["kind"], r["node"], r["round"]

    followed_ids = [ident(json.loads(line)) for line in followed.splitlines()]
    assert len(followed_ids) == len(set(followed_ids))
    assert set(followed_ids) <= {ident(r) for r in records}
    before_close = {ident(r) for r in records if r["time"] <= shrunk.time}
    assert before_close <= set(followed_ids)

    def index(kind: str, start: int = 0, **match: Any) -> int:
        for i in range(start, len(records)):
            r = records[i]
            if r["kind"] == kind and all(r["fields"].get(k) == v if k != "round" else
                                         r["round"] == v for k, v in match.items()):
                return i
        raise AssertionError(f"no {kind} {match} after event {start} in\n"
                             + "\n".join(map(json.dumps, records)))

    rounds = {r["round"]: r for r in records if r["kind"] == "round_formed"}
    c_id = next(n for n in rounds[joined.round]["fields"]["newcomers"])
    d_id = next(n for n in rounds[grown.round]["fields"]["newcomers"])
    # SIGKILL: rdzv's server and the file store see the connection end at once, unless the
    # machine is so loaded that the survivor notices only after the session ttl: either is a
    # right answer; etcd sees only the lease run out
    lost_reasons = {"heartbeat_missed"} if name == "etcd" else {"connection_lost",
                                                                 "heartbeat_missed"}
    i = index("round_formed", round=first.round, world_size=2, cause="initial")
    i = index("workers_started", i)
    i = index("node_waiting", i)
    i = index("round_formed", i, round=joined.round, world_size=3, newcomers=[c_id])
    i = index("node_leaving", i)
    i = index("round_formed", i, round=after_leave.round, cause="leave",
              left=[{"node": c_id, "reason": "graceful_leave"}])
    i = index("worker_failed", i, rank=1, exit_code=1,
              error="ValueError: rank 1 fails on purpose")
    i = index("round_formed", i, round=restarted.round, cause="restart")
    index("restart_fallback", i, round=restarted.round, cause="worker_failed")  # said once
    causes = [r["fields"]["cause"] for r in records if r["kind"] == "restart_fallback"]
    # the workers here do not use the in-process API: every change restarts them, once each
    assert causes.count("worker_failed") == 1 and set(causes) == {"worker_failed",
                                                                  "not_inprocess"}, causes
    i = index("workers_restarted", i, restarts=1)  # counted when the round restarts them
    i = index("training_paused", i, cause="worker_failed")
    i = index("round_formed", i, round=grown.round, newcomers=[d_id], cause="join")
    i = index("node_lost", i, lost=d_id)
    lost_reason = records[i]["fields"]["reason"]
    assert lost_reason in lost_reasons, records[i]
    i = index("round_formed", i, round=shrunk.round, cause="loss",
              left=[{"node": d_id, "reason": lost_reason}])
    i = index("training_paused", i, cause="membership_change")
    index("run_closed", i, reason="workers_succeeded")
    assert [r["kind"] for r in records].count("run_closed") == 1  # said by the node that closed it
    assert all(r["fields"]["formation_s"] >= 0 for r in rounds.values())

    text = cli(backend)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert len(lines) == len(records)
    short_c = c_id.rsplit(":", 1)[0]
    assert any(f"round {after_leave.round}" in line and "formed in" in line and
               f"{short_c} left: graceful leave" in line for line in lines), text.stdout
    assert any("worker rank 1 failed with exit code 1: ValueError: rank 1 fails on purpose"
               in line for line in lines), text.stdout
    assert any("every worker restarts (the fallback, decided by" in line and
               "worker failed" in line for line in lines), text.stdout
    assert any("left: " + lost_reason.replace("_", " ") in line for line in lines)

    # --since: only what happened after the moment given
    late = cli(backend, "--json", "--since", f"@{rounds[grown.round]['time']}")
    late_kinds = [json.loads(line)["kind"] for line in late.stdout.splitlines()]
    assert "node_leaving" not in late_kinds and "run_closed" in late_kinds
