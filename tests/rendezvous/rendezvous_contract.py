"""The rendezvous contract: torch's documented dynamic-rendezvous semantics, for every backend.

Subclass :class:`RendezvousContract` in a ``test_*.py`` module of ``tests/rendezvous`` (import
it with ``from rendezvous_contract import RendezvousContract``) and give the subclass a fixture ``cluster``
yielding an object with:

* ``backend``: the name the nodes' handlers are created by;
* ``node(min_nodes, max_nodes, run_id="job", **options)``: a new node (a :class:`ThreadNode`
  or :class:`ProcessNode` of ``_nodes.py``) of one fresh store, closed at teardown;
* ``raw_store()``: a client of that store (to plant corrupt data);
* ``processes``: whether nodes are processes (then kill is SIGKILL and hung nodes are tested);
* ``hung_options``: backend options giving a short heartbeat ttl (``heartbeat_interval`` x
  ``heartbeat_misses``), or None when the backend has no heartbeat.

Every wait is bounded; timing bounds are generous (a loaded 2-core machine) and only separate
"at once" from "after a timeout that is set much longer".
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from _nodes import NodeError
from _waiting import eventually

from rdzv.rendezvous._layout import RunKeys, decode_rank, decode_status

LONG = 60.0
"""A last-call or join timeout that a test must NOT wait for."""
AT_ONCE = 30.0
"""Results expected "at once" must arrive within this (far below LONG)."""




def process_state(pid: int) -> str:
    """The state letter /proc gives process ``pid`` (T: stopped), for failure messages."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"


def form(nodes: list[Any], timeout: float = AT_ONCE) -> list[dict[str, Any]]:
    """Every node calls next_rendezvous; their results in the order of ``nodes``."""
    pending = [node.request("next") for node in nodes]
    return [p.result(timeout) for p in pending]


def check_round(results: list[dict[str, Any]], world_size: int) -> None:
    assert sorted(r["rank"] for r in results) == list(range(world_size))
    assert {r["world_size"] for r in results} == {world_size}
    assert len({(r["addr"], r["port"]) for r in results}) == 1, "one bootstrap store per round"


class RendezvousContract:
    DEATH_IN_LAST_CALL = 2.0
    """The last call of the round a node dies in: long enough for the backend to drop it (a
    backend that sees a death only when a lease expires sets a longer one)."""

    def test_handler_names_the_backend_it_was_created_for(self, cluster):
        """torch's registry refuses a handler whose get_backend() is not the backend asked for
        (rdzv's too): each backend's handler says its name."""
        assert cluster.node(1, 1).request("get_backend").result(AT_ONCE) == cluster.backend

    # -- barrier -------------------------------------------------------------------------------
    def test_round_completes_at_once_when_max_nodes_join(self, cluster):
        nodes = [cluster.node(2, 3, last_call_timeout=LONG) for _ in range(3)]
        check_round(form(nodes), 3)

    def test_min_nodes_complete_after_last_call(self, cluster):
        nodes = [cluster.node(2, 4, last_call_timeout=1.0) for _ in range(2)]
        started = time.monotonic()
        check_round(form(nodes), 2)
        assert time.monotonic() - started >= 0.9, "completed before the last call ended"

    def test_join_timeout_when_min_nodes_never_join(self, cluster):
        node = cluster.node(2, 2, join_timeout=1.0)
        with pytest.raises(NodeError) as info:
            node.call("next", timeout=AT_ONCE)
        assert info.value.type_name == "RendezvousTimeoutError"
        assert "did not form" in str(info.value)

    def test_round_store_is_shared_by_members_and_scoped_to_round_and_run(self, cluster):
        a, b = cluster.node(2, 2), cluster.node(2, 2)
        form([a, b])
        a.call("store_set", "greeting", "hello")
        assert b.call("store_get", "greeting") == "hello"
        other = [cluster.node(2, 2, run_id="other") for _ in range(2)]
        form(other)
        assert other[0].call("store_get", "greeting") is None, "leaked into another run"
        form([a, b])
        assert b.call("store_get", "greeting") is None, "leaked into the next round"

    # -- exclusivity ---------------------------------------------------------------------------
    def test_late_node_waits_and_is_admitted_when_members_rejoin(self, cluster):
        a, b = cluster.node(2, 3, last_call_timeout=0.5), cluster.node(2, 3, last_call_timeout=0.5)
        first = form([a, b])
        check_round(first, 2)
        late = cluster.node(2, 3, last_call_timeout=0.5)
        pending = late.request("next")
        eventually(lambda: a.call("waiting") == 1, AT_ONCE, "members see the late node")
        assert b.call("wait_change", AT_ONCE) is True
        time.sleep(1.0)  # well past the last call: the late node must not form a group alone
        assert not pending.done(), "the late node formed a second group"
        second = form([a, b])
        third = pending.result(AT_ONCE)
        check_round(second + [third], 3)
        assert [r["rank"] for r in second] == [r["rank"] for r in first], "survivors keep ranks"
        assert third["rank"] == 2

    def test_wait_for_membership_change_times_out_when_nothing_changes(self, cluster):
        a, b = cluster.node(2, 2), cluster.node(2, 2)
        form([a, b])
        assert a.call("wait_change", 0.3) is False
        assert a.call("waiting") == 0

    def test_membership_polled_while_nothing_changes_sees_the_same_round(self, cluster):
        """The membership watcher's poll: without a change each call says the same (members
        alive, none waiting) at the same revision; a joiner shows at once as waiting."""
        a, b = (cluster.node(2, 3, last_call_timeout=0.3) for _ in range(2))
        form([a, b])
        seen = a.call("membership")
        assert seen[:4] == [2, 0, 0, False] and seen[4] > 0
        for _ in range(3):
            assert a.call("membership", seen[4], 0.2) == seen
        joiner = cluster.node(2, 3, last_call_timeout=0.3)
        joiner.request("next")
        now = a.call("membership", seen[4], AT_ONCE)
        assert now[:4] == [2, 1, 0, False] and now[4] > seen[4]

    def test_runs_do_not_mix(self, cluster):
        nodes = [cluster.node(2, 2, run_id=run) for run in ("x", "y", "x", "y")]
        results = form(nodes)
        check_round(results[0::2], 2)
        check_round(results[1::2], 2)

    # -- fault tolerance ------------------------------------------------------------------------
    def test_node_dying_before_completion_is_dropped(self, cluster):
        a, doomed = [cluster.node(2, 3, last_call_timeout=LONG) for _ in range(2)]
        first = a.request("next")
        doomed.request("next")
        eventually(lambda: a.call("waiting") == 2, AT_ONCE, "two joined")
        doomed.kill()
        eventually(lambda: a.call("waiting") == 1, AT_ONCE, "the dead node is dropped")
        b = cluster.node(2, 3, last_call_timeout=LONG)
        second = b.request("next")
        eventually(lambda: a.call("waiting") == 2, AT_ONCE, "b joined, the dead node not counted")
        assert not first.done(), "the dead node was counted towards max_nodes"
        c = cluster.node(2, 3, last_call_timeout=LONG)
        third = c.request("next")
        check_round([first.result(AT_ONCE), second.result(AT_ONCE), third.result(AT_ONCE)], 3)

    def test_round_completes_without_a_node_that_died_in_the_last_call(self, cluster):
        nodes = [cluster.node(2, 4, last_call_timeout=self.DEATH_IN_LAST_CALL)
                 for _ in range(3)]
        pending = [n.request("next") for n in nodes]
        eventually(lambda: nodes[0].call("waiting") == 3, AT_ONCE, "three joined")
        nodes[2].kill()
        eventually(lambda: nodes[0].call("waiting") == 2, AT_ONCE, "the dead node is dropped")
        check_round([p.result(AT_ONCE) for p in pending[:2]], 2)

    def test_sealer_dying_with_its_lock_is_replaced_at_once(self, cluster):
        holder = cluster.raw_store()  # a sealer that took the lock and died before sealing
        holder.set(RunKeys("job").sealer(0), "dead-sealer", ephemeral=True)
        nodes = [cluster.node(2, 2) for _ in range(2)]
        pending = [n.request("next") for n in nodes]
        eventually(lambda: nodes[0].call("waiting") == 2, AT_ONCE, "both joined")
        time.sleep(0.5)  # a window in which nodes that ignored the held lock would seal
        assert not any(p.done() for p in pending), "sealed while another node held the lock"
        holder.close()  # its session ends: the lock goes, the waiting nodes seal
        check_round([p.result(AT_ONCE) for p in pending], 2)

    def test_member_killed_after_completion_is_noticed_and_replaced(self, cluster):
        nodes = [cluster.node(2, 3, last_call_timeout=LONG) for _ in range(3)]
        first = form(nodes)
        nodes[2].kill()
        assert nodes[0].call("wait_change", AT_ONCE) is True
        assert nodes[1].call("wait_change", AT_ONCE) is True
        second = form(nodes[:2])  # no last call: every alive member is back
        check_round(second, 2)
        kept = {r["rank"] for r in first[:2]} & {0, 1}
        assert {r["rank"] for r in second} >= kept, "survivors with rank < 2 keep their rank"

    def test_a_lost_member_frees_its_place_for_the_node_waiting(self, cluster):
        """A full round (max_nodes members) ignores the spare waiting; once a member is gone
        the spare is no longer one: members count it and the lost member (issue 22: torch's
        agent re-forms only when num_nodes_waiting() is positive)."""
        nodes = [cluster.node(1, 2, last_call_timeout=LONG) for _ in range(3)]
        check_round(form(nodes[:2]), 2)
        pending = nodes[2].request("next")
        eventually(lambda: nodes[0].call("changes") == [0, 0] and pending.done() is False
                   and nodes[2].call("waiting") == 1, AT_ONCE, "the spare waits, not counted")
        nodes[1].call("shutdown")  # gone: a member lost or leaving, as the members see it
        eventually(lambda: nodes[0].call("changes") == [1, 1], AT_ONCE,
                   "the spare counted, and the member lost")
        assert nodes[0].call("waiting") == 1
        check_round([nodes[0].call("next"), pending.result(AT_ONCE)], 2)
        assert nodes[0].call("changes") == [0, 0]

    def test_hung_node_is_dropped_after_its_heartbeat_ttl(self, cluster):
        if not cluster.processes or cluster.hung_options is None:
            pytest.skip("needs process nodes and a heartbeat ttl")
        nodes = [cluster.node(2, 3, last_call_timeout=LONG, **cluster.hung_options)
                 for _ in range(3)]
        form(nodes)
        nodes[2].stop()
        try:
            assert nodes[0].call("wait_change", AT_ONCE) is True
            check_round(form(nodes[:2]), 2)
        finally:
            nodes[2].resume()
            nodes[2].kill()

    def test_a_sealer_paused_past_its_ttl_does_not_write_a_second_decision(self, cluster, tmp_path):
        """A sealer stops (SIGSTOP) after listing the joiners of round 0 (itself, a, c), longer
        than its session ttl: its lock and descriptor expire, a and c seal round 0 without it
        (world size 2). Resumed (SIGCONT), the stale sealer must not write its decision (world
        size 3) into round 0: round 0 keeps one decision, the one its members got; the stale
        node joins again and forms round 1 with them."""
        if not cluster.processes or cluster.hung_options is None:
            pytest.skip("needs process nodes and a heartbeat ttl")
        marker = str(tmp_path / "stopped-in-seal")
        fast = {"last_call_timeout": 0.3, **cluster.hung_options}
        stale = cluster.node(2, 4, stop_in_seal=marker, **fast)
        # (a and c keep the cluster's longer ttl: a loaded machine must not expire them too)
        a, c = cluster.node(2, 4, last_call_timeout=3.0), cluster.node(2, 4, last_call_timeout=3.0)
        stale_pending = stale.request("next")
        eventually(lambda: stale.call("waiting") >= 1, AT_ONCE, "the sealer waits in round 0")
        pending = [a.request("next"), c.request("next")]
        eventually(lambda: os.path.exists(marker), AT_ONCE, "the sealer stopped in its seal")
        stale._stopped = True  # (stopped by itself: resumed at teardown if the test fails)
        with open(marker) as listed:
            assert listed.read() == "3", "the stale sealer listed itself, a and c"
        try:
            first = [p.result(AT_ONCE + 30) for p in pending]  # past the ttl, without it
            check_round(first, 2)
        finally:
            open(marker + ".go", "w").close()
            # A stray SIGCONT may have woken it before ".go" existed, and it stops itself
            # again: resume it until it runs (bounded).
            eventually(lambda: stale.resume() or process_state(stale.pid) != "T", AT_ONCE,
                       "the stale sealer running again")
        # The stale node either joins again as a new node (a and c see it waiting for round
        # 1), or, where its store cannot give it a new session (FileStore), fails clearly.
        # (it may stop itself once more: it had found no ".go" just before, and a loaded
        # machine ran it only later; so it is resumed whenever it is seen stopped)
        def outcome() -> bool:
            if process_state(stale.pid) == "T":
                stale.resume()
            return stale_pending.done() or a.call("waiting") >= 1
        try:
            eventually(outcome, AT_ONCE, "the stale node's outcome")
        except AssertionError as exc:
            raise AssertionError(f"{exc} (its process state: {process_state(stale.pid)})")
        store, keys = cluster.raw_store(), RunKeys("job")
        round0 = {"status": store.try_get(keys.status(0)), "ranks": store.list_keys(
            keys.round(0) + "rank/")}  # (read before a and c delete their rank records)
        status = decode_status(keys.status(0), round0["status"])
        assert status is not True and status is not None
        assert status.world_size == 2, f"round 0's status was rewritten: {round0['status']!r}"
        records = [decode_rank(key, raw) for key, raw in round0["ranks"].items()]
        assert all(decision == status for _, decision in records), (
            f"round 0's keys mix two decisions: {round0}")
        assert sorted(rank for rank, _ in records) == [0, 1]
        if stale_pending.done():
            with pytest.raises(NodeError) as info:
                stale_pending.result()
            assert info.value.type_name == "SessionExpiredError", info.value
            assert "expired" in str(info.value)
            return
        assert a.call("wait_change", AT_ONCE) is True
        assert c.call("wait_change", AT_ONCE) is True
        check_round(form([a, c]) + [stale_pending.result(AT_ONCE)], 3)

    # -- closing and leaving --------------------------------------------------------------------
    def test_set_closed_is_seen_by_members_and_waiters(self, cluster):
        # max 3: the late node fits (with max 2 it would be a spare, which members do not count)
        a, b = cluster.node(2, 3, last_call_timeout=0.5), cluster.node(2, 3, last_call_timeout=0.5)
        form([a, b])
        late = cluster.node(2, 3, last_call_timeout=0.5)
        pending = late.request("next")
        eventually(lambda: a.call("waiting") == 1, AT_ONCE, "the late node waits")
        a.call("set_closed")
        eventually(lambda: b.call("is_closed"), AT_ONCE, "b sees the close")
        with pytest.raises(NodeError) as info:
            pending.result(AT_ONCE)
        assert info.value.type_name == "RendezvousClosedError"
        with pytest.raises(NodeError) as info:
            b.call("next")
        assert info.value.type_name == "RendezvousClosedError"

    def test_shutdown_is_seen_by_peers_at_once(self, cluster):
        nodes = [cluster.node(2, 3, last_call_timeout=LONG) for _ in range(3)]
        form(nodes)
        assert nodes[2].call("shutdown") is True
        assert nodes[0].call("wait_change", AT_ONCE) is True
        check_round(form(nodes[:2]), 2)

    def test_next_rendezvous_async_forms_in_background(self, cluster):
        a, b = cluster.node(2, 2), cluster.node(2, 2)
        pending = a.request("next")
        eventually(lambda: a.call("waiting") == 1, AT_ONCE, "a waits in round 0 for a second node")
        assert not pending.done(), "a round of one formed"
        b_result = b.call("next")
        check_round([pending.result(AT_ONCE), b_result], 2)

    # -- bad data -------------------------------------------------------------------------------
    def test_foreign_state_raises_state_error_naming_the_key(self, cluster):
        store = cluster.raw_store()
        store.set("rdzv/job/round/0/ctl/status", b"not json")
        node = cluster.node(1, 1)
        with pytest.raises(NodeError) as info:
            node.call("next")
        assert info.value.type_name == "RendezvousStateError"
        assert "rdzv/job/round/0/ctl/status" in str(info.value)
