"""The history of a run whose workers change rounds in-process (real agents, real torch, gloo):
a join is recorded as a switch and a SIGKILLed node as a recovery, each with its step and how
long training paused, and no worker restart."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from _launcher import PYTHON, RDZV_RUN, Launcher, free_port
from _waiting import eventually as wait_for
from test_inprocess import EXAMPLE, PHASE_TIMEOUT, progress

from rdzv.rendezvous import format_event, read_events
from rdzv.store._tcp import TCPStore


@pytest.mark.timeout(600)
def test_in_process_switch_and_recovery_are_recorded(launcher: Launcher, tmp_path: Path) -> None:
    port = free_port()
    server = launcher.start([PYTHON, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                             "--port", str(port)])
    wait_for(lambda: "listening on" in server.output(), PHASE_TIMEOUT, "the store server")
    log = tmp_path / "progress.jsonl"
    args = [*RDZV_RUN, "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "tcp",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
            "--rdzv-conf", "last_call_timeout=1,is_host=0", "--local-addr", "127.0.0.1",
            "--log-dir", str(tmp_path / "logs"), "--stop-timeout", "5", "--max-restarts", "0",
            EXAMPLE, "--steps", "300", "--checkpoint", str(tmp_path / "model.ckpt"),
            "--progress", str(log), "--log-every", "1", "--save-every", "50",
            "--step-sleep", "0.03"]
    first, second = launcher.start(args), launcher.start(args)

    def steps_at(world_size: int, after: int = 0) -> int:
        return sum(1 for e in progress(log)[after:] if e["world_size"] == world_size)

    wait_for(lambda: steps_at(2) >= 20, PHASE_TIMEOUT, "20 steps at world size 2")
    third = launcher.start(args)
    wait_for(lambda: steps_at(3) >= 20, PHASE_TIMEOUT, "20 steps at world size 3")
    before = len(progress(log))
    os.killpg(third.pid, signal.SIGKILL)
    third.wait(PHASE_TIMEOUT)
    wait_for(lambda: steps_at(2, before) >= 10, PHASE_TIMEOUT, "10 steps at 2 after the kill")
    assert [first.wait(PHASE_TIMEOUT), second.wait(PHASE_TIMEOUT)] == [0, 0], (
        first.output()[-5000:] + second.output()[-5000:])

    store = TCPStore("127.0.0.1", port, timeout=30)
    events = read_events(store, "job").events
    store.close()
    kinds = [e.kind for e in events]
    switched = [e for e in events if e.kind == "switched_in_process" and not e.fields.get("newcomer")]
    recovered = [e for e in events if e.kind == "recovered_in_process"]
    timeline = "\n".join(format_event(e) for e in events)
    assert len(switched) == 2, timeline  # the two members switched to the round of 3
    assert len(recovered) == 2, timeline  # ... and recovered in the round without the third
    for event in switched + recovered:
        assert isinstance(event.fields["step"], int) and event.fields["pause_s"] >= 0
    assert {e.round for e in recovered} == {max(e.round for e in events
                                                if e.kind == "round_formed")}
    lost = [e for e in events if e.kind == "node_lost"]
    assert len(lost) == 1 and lost[0].fields["reason"] == "connection_lost", lost
    started = [e for e in events if e.kind == "workers_started"]
    assert len(started) == 3, started  # one start per node: nothing restarted
    assert kinds.count("run_closed") == 1
