"""A real agent whose store session expires while it shares its worker counts, right after a
round formed (it was SIGSTOPped past its session ttl just then): it re-forms, not exit 1.

The other node of the run is this test, joining through the library's own rendezvous handler,
so that it can seal the round at the moment the agent is stopped. The store is a server in this
process, not the agent's, so that stopping the agent stops no server, and so that the test sees
the agent wait on it and its session expire.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from _agents import JOIN, wait_for
from _launcher import PYTHON, free_port

from rdzv.agent._decide import DecideContext, decide
from rdzv.agent._records import (
    NodeRecord,
    SlotReport,
    SlotState,
    dumps_assignment,
    dumps_decision,
    dumps_record,
)
from rdzv.agent._watch import read_records
from rdzv.rendezvous import (
    AGENT_DECISION,
    AGENT_READY,
    RendezvousInfo,
    RendezvousParameters,
    assign_key,
    get_rendezvous_handler,
    ready_key,
    record_key,
)
from rdzv.rendezvous._layout import RunKeys
from rdzv.server import StoreServer
from rdzv.store import TCPStore

pytestmark = pytest.mark.timeout(600)

HEARTBEAT, MISSES = 2.0, 3
"""The run's session ttl is 6 s; an idle client waits on the server in 2 s chunks."""


def test_a_session_expiring_while_ranks_are_assigned_makes_the_agent_reform(
    agents: Any, tmp_path: Any
) -> None:
    with StoreServer("127.0.0.1", 0) as server:
        port = server.port
        endpoint = f"127.0.0.1:{port}"
        core = server._core
        assert core is not None
        conf = f"heartbeat_interval={HEARTBEAT},heartbeat_misses={MISSES},is_host=0"
        node = agents.start([
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "tcp",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--rdzv-conf", conf,
            "--local-addr", "127.0.0.1", "--log-dir", str(tmp_path / "logs"),
            "--stop-timeout", "5", "--no-python", PYTHON, "-c", "import time; time.sleep(600)",
        ])
        observer = TCPStore("127.0.0.1", port, timeout=30)
        joined = RunKeys("job").nodes(0)
        wait_for(lambda: observer.count_keys(joined) == 1, JOIN, "the agent joined round 0")
        control = RunKeys("job").ctl(0)
        wait_for(lambda: core.waiters.get(control), JOIN,
                 "the agent to wait on the server for the round (a 2 s chunk)")
        node.signal(signal.SIGSTOP)
        me = get_rendezvous_handler(RendezvousParameters(
            "tcp", endpoint, "job", 2, 2, heartbeat_interval=HEARTBEAT, heartbeat_misses=MISSES,
            is_host=False,
        ))
        info = me.next_rendezvous()  # seals round 0 with the stopped agent: its answer waits
        assert info.world_size == 2
        # The agent's session ends 6 s after its last request; then it may go on.
        wait_for(lambda: observer.count_keys(joined) <= 1, JOIN, "the agent's session expired")
        wait_for(lambda: server.metrics().sessions_expired == 1, JOIN,
                 "the server to count the agent's session as expired")
        node.signal(signal.SIGCONT)
        try:
            wait_for(lambda: "re-forming" in node.output() or node.process.poll() is not None,
                     JOIN, "the agent to react")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the agent said:\n{node.output()}") from None
        assert node.process.poll() is None, node.output()
        info = me.next_rendezvous()  # round 1, with the agent back in it
        assert info.world_size == 2
        play_a_node_without_workers(info)
        wait_for(lambda: "round complete: 2 node(s)" in node.output(), JOIN,
                 "the agent's workers in the new round")
        text = node.output()
        assert "round formed" in text.split("re-forming")[0], text  # it expired after the round
        assert "SessionExpiredError" not in text.split("round complete")[-1], text
        node.signal(signal.SIGTERM)  # min_nodes 2: the other node needs it, so it stops now
        assert node.wait() == 128 + signal.SIGTERM, node.output()
        assert "cannot go on without this one" in node.output()
        me.shutdown()
        observer.close()


def play_a_node_without_workers(info: RendezvousInfo) -> None:
    """This test's part in a round, as an agent without workers plays it: its final record,
    and (as group rank 0) the round's decision from both records."""
    mine = NodeRecord(slots=(SlotReport(SlotState.ABSENT),), role="default", host="127.0.0.1",
                      port=free_port(), final=True)
    info.store.set(record_key(info.rank), dumps_record(mine))
    info.store.set(ready_key(info.rank), b"1")
    if info.rank != 0:
        return
    wait_for(lambda: info.store.count_keys(AGENT_READY) == 2, JOIN, "the agent's record")
    decision, assignments = decide(read_records(info.store, 2),
                                   DecideContext("t1", "test", time.time(), 2))
    info.store.multi_set([assign_key(decision.id, g) for g in assignments],
                         [dumps_assignment(a) for a in assignments.values()])
    info.store.compare_set(AGENT_DECISION, b"", dumps_decision(decision).encode())
