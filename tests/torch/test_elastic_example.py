"""examples/elastic_train.py under ``rdzv run``: 2 nodes, a third joins, one is killed; both changes
are made in-process and training goes on, and the run's history records them: the join as a
switch and the SIGKILLed node as a recovery, each with its step and how long training paused.

Each node is a real agent (``python -m rdzv.run``) with 2 workers on loopback, on a standalone
store server (``rdzv serve``); rank 0 of the example appends its progress (step, world size,
loss) to a JSON-lines file the test reads.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from _launcher import EXAMPLES, PYTHON, RDZV_RUN, Launcher, free_port
from _waiting import eventually as wait_for

from rdzv.rendezvous import format_event, read_events
from rdzv.store._tcp import TCPStore

EXAMPLE = str(EXAMPLES / "elastic_train.py")
STEPS = 400
PHASE_TIMEOUT = 180.0
"""Seconds for one membership change (stop, re-form, restart 6 torch workers) on 2 loaded cores."""


def progress(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(900)
def test_training_goes_on_through_a_join_and_a_kill(launcher: Launcher, tmp_path: Path) -> None:
    port = free_port()
    server = launcher.start([PYTHON, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                             "--port", str(port)])
    wait_for(lambda: "listening on" in server.output(), PHASE_TIMEOUT, "the store server")
    log = tmp_path / "progress.jsonl"
    agent_args = [
        *RDZV_RUN, "--nnodes", "2:3", "--nproc-per-node", "2",
        "--rdzv-backend", "tcp", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
        "--rdzv-conf", "last_call_timeout=1,heartbeat_interval=1,heartbeat_misses=3,is_host=0",
        "--local-addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs"), "--stop-timeout", "5",
        "--max-restarts", "0",
        EXAMPLE, "--steps", str(STEPS), "--checkpoint", str(tmp_path / "model.ckpt"),
        "--progress", str(log), "--log-every", "5", "--save-every", "10", "--step-sleep", "0.05",
    ]
    first, second = launcher.start(agent_args), launcher.start(agent_args)

    def reached(world_size: int, steps: int, after: int = 0) -> bool:
        seen = [e for e in progress(log)[after:] if e["world_size"] == world_size]
        return len(seen) * 5 >= steps

    wait_for(lambda: reached(4, 20), PHASE_TIMEOUT, "20 steps at world size 4")
    third = launcher.start(agent_args)
    wait_for(lambda: reached(6, 10), PHASE_TIMEOUT, "10 steps at world size 6 after a join")
    before_kill = len(progress(log))
    os.killpg(third.pid, signal.SIGKILL)
    third.wait(30)
    wait_for(lambda: reached(4, 10, before_kill), PHASE_TIMEOUT, "10 steps at world size 4 after a kill")

    codes = [first.wait(PHASE_TIMEOUT), second.wait(PHASE_TIMEOUT)]
    assert codes == [0, 0], first.output()[-5000:] + second.output()[-5000:]
    entries = progress(log)
    phases = [e["world_size"] for i, e in enumerate(entries) if i == 0 or entries[i - 1]["world_size"] != e["world_size"]]
    said = "\n".join(line for node in (first, second, third) for line in node.output().splitlines()
                     if line.startswith("[rdzv"))
    assert phases == [4, 6, 4], (phases, said)  # the agents' lines say what each change was
    assert entries[-1]["step"] == STEPS
    for earlier, later in zip(entries, entries[1:]):  # nothing goes back to the last checkpoint
        assert later["step"] > earlier["step"] - 10, (earlier, later)
    first_loss = entries[0]["loss"]
    starts = [e for i, e in enumerate(entries) if i and entries[i - 1]["world_size"] != e["world_size"]]
    assert all(start["loss"] < first_loss for start in starts), (first_loss, starts)
    assert entries[-1]["loss"] < first_loss / 4, (first_loss, entries[-1])
    means, current = [], []
    for i, entry in enumerate(entries):  # the mean loss of each membership phase
        if i and entries[i - 1]["world_size"] != entry["world_size"]:
            means.append(sum(current) / len(current))
            current = []
        current.append(entry["loss"])
    means.append(sum(current) / len(current))
    # goes down, or wobbles once the loss has converged (a restart from scratch would bring
    # back the first phase's loss)
    assert all(later < earlier * 1.5 for earlier, later in zip(means, means[1:])), means
    text = first.output()
    assert "starting at step 0 with world size 4" in text
    assert "world size 6 at step" in text and "parameters identical on all ranks" in text
    assert "switched in" in text and "recovered in-process" in text  # the join, the kill
    assert text.count("started 2 worker(s)") == 1, text  # no worker restarted
    assert f"done: {STEPS} steps" in text

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
