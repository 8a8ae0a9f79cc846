"""The run's history: its pure rules as tables (why a member left, how it was lost, what caused
a round, pruning, formatting, --since), and the reader and writer on a real store server: corrupt
records reported and skipped, the history bounded over a hundred times its size, a store that is
gone or full losing events but never failing the rendezvous."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from datetime import datetime
from typing import Any

import pytest

from rdzv.store import TCPStore
from rdzv.rendezvous import EventWriter, RunEvent, get_rendezvous_handler, read_events
from rdzv.rendezvous._history import (
    decode_event,
    encode_event,
    events_dir,
    new_event,
    round_event_key,
)
from rdzv.rendezvous._history_bounds import (
    DEFAULT_HISTORY_SIZE,
    MAX_EVENT_BYTES,
    MAX_HISTORY_SIZE,
    may_take,
    prune_plan,
    prune_slack,
)
from rdzv.rendezvous._history_facts import (
    decode_left_mark,
    encode_left_mark,
    round_cause,
    previous_members,
    round_formed,
    why_left,
    why_lost,
)
from rdzv.rendezvous._layout import RunKeys
from rdzv.rendezvous._timeline import format_event, format_seconds, parse_since, short_node
from rdzv.server import StoreServer

from _launcher import PYTHON


def rdzv_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``rdzv ARGV...`` as a user types it, run to its end."""
    return subprocess.run([PYTHON, "-m", "rdzv", *argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)


@pytest.fixture
def server() -> Any:
    with StoreServer("127.0.0.1", 0) as running:
        yield running


def client(server: Any) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, timeout=30)


# -- pure rules -----------------------------------------------------------------------------------
@pytest.mark.parametrize("silent, heartbeat, ttl, reason", [
    (0.2, 1.0, 3.0, "connection_lost"),        # SIGKILL: its connection ended at once
    (2.4, 1.0, 3.0, "connection_lost"),        # ... up to a beat and a half (+1 s) of silence
    (2.7, 1.0, 3.0, "heartbeat_missed"),       # silent for its session ttl: hung, frozen
    (16.0, 5.0, 15.0, "heartbeat_missed"),
    (4.9, 5.0, 15.0, "connection_lost"),       # the default settings: a beat every 5 s
    (10.0, 5.0, 15.0, "lost"),                 # between the two: cannot tell
    (None, 1.0, 3.0, "lost"),                  # never seen
    (-1.0, 1.0, 3.0, "lost"),                  # clock skew
])
def test_why_lost(silent: float | None, heartbeat: float, ttl: float, reason: str) -> None:
    assert why_lost(silent, heartbeat, ttl) == reason


@pytest.mark.parametrize("node, marks, closed, reason", [
    ("a", {"a": "graceful_leave"}, False, "graceful_leave"),
    ("a", {"a": "heartbeat_missed"}, True, "heartbeat_missed"),  # the mark is more precise
    ("a", {"b": "graceful_leave"}, True, "closed"),
    ("a", {}, False, "lost"),
])
def test_why_left(node: str, marks: dict[str, str], closed: bool, reason: str) -> None:
    assert why_left(node, marks, closed) == reason


@pytest.mark.parametrize("r, known, newcomers, left, cause", [
    (0, True, 2, [], "initial"),
    (3, False, 0, [], "initial"),
    (3, True, 1, [], "join"),
    (3, True, 0, ["graceful_leave"], "leave"),
    (3, True, 1, ["graceful_leave", "connection_lost"], "loss"),
    (3, True, 0, ["lost"], "loss"),
    (3, True, 0, [], "restart"),
])
def test_round_cause(r: int, known: bool, newcomers: int, left: list[str], cause: str) -> None:
    assert round_cause(r, known, newcomers, left) == cause


def test_round_formed_names_newcomers_and_who_left_why() -> None:
    previous = RunEvent(1, 1.0, "round_formed", 4, "a", {"members": ["a", "b", "c"]})
    event = round_formed(5, {"a": 0, "c": 1, "d": 2}, {"a": 0, "c": 2, "d": None}, [9.0, 9.5],
                         previous, {"b": "heartbeat_missed"}, False, "a")
    assert (event.kind, event.round, event.node) == ("round_formed", 5, "a")
    assert event.fields["members"] == ["a", "c", "d"]
    assert event.fields["newcomers"] == ["d"]
    assert event.fields["left"] == [{"node": "b", "reason": "heartbeat_missed"}]
    assert event.fields["cause"] == "loss"
    assert event.fields["formation_s"] == pytest.approx(event.time - 9.0, abs=1e-5)
    # without the previous round's event: newcomers from the joiners' previous ranks
    unknown = round_formed(5, {"a": 0, "d": 1}, {"a": 0, "d": None}, [], None, {}, False, "a")
    assert unknown.fields["newcomers"] == ["d"] and unknown.fields["cause"] == "initial"
    assert "formation_s" not in unknown.fields


def test_a_huge_round_keeps_its_event_small() -> None:
    ranks = {f"node-{i:05d}": i for i in range(5000)}
    event = round_formed(0, ranks, dict.fromkeys(ranks), [1.0], None, {}, False, "node-00000")
    assert 0 < len(event.fields["members"]) <= 256 and event.fields["members_count"] == 5000
    assert len(encode_event(event)) <= MAX_EVENT_BYTES


def test_a_300_node_round_with_long_ids_fits_the_event_bound() -> None:
    ids = [f"worker-node-{i:04d}.cluster.example.com:{40000 + i}:0badcafe" for i in range(300)]
    previous = RunEvent(1, 1.0, "round_formed", 0, ids[0], {"members": ids[:150]})
    event = round_formed(1, {node: i for i, node in enumerate(ids)}, {}, [1.0], previous,
                         {}, False, ids[0])
    assert len(encode_event(event)) <= MAX_EVENT_BYTES
    assert event.fields["members_count"] == 300 and event.fields["newcomers_count"] == 150
    assert event.fields["members"] == ids[:len(event.fields["members"])]
    # the listing of a full history of such events stays under the store's 64 MiB frame
    key = len(round_event_key(RunKeys("a-run-id-of-64-characters".ljust(64, "x")), 0)) + 16
    most = MAX_HISTORY_SIZE + prune_slack(MAX_HISTORY_SIZE)
    assert most * (MAX_EVENT_BYTES + key + 16) < 60 << 20


@pytest.mark.parametrize("fields, members", [
    ({"members": ["a", "b"]}, ["a", "b"]),
    ({"members": [["x"]]}, None),              # corrupt: not node ids
    ({"members": ["a", 7]}, None),
    ({"members": "ab"}, None),
    ({"members": {"a": 0}}, None),
    ({}, None),
    ({"members": ["a"], "members_count": 300}, None),  # clipped: names not all
])
def test_previous_members_only_trusts_a_list_of_node_ids(fields: dict[str, Any],
                                                         members: list[str] | None) -> None:
    previous = RunEvent(1, 1.0, "round_formed", 4, "a", fields)
    assert previous_members(previous, 5) == members
    assert previous_members(previous, 6) is None  # another round's
    event = round_formed(5, {"a": 0, "b": 1, "c": 2}, {"a": 0, "b": 1, "c": None}, [],
                         previous, {}, False, "a")
    assert event.fields["cause"] == ("join" if members else "initial")
    assert event.fields["newcomers"] == ["c"]


def test_a_corrupt_round_event_does_not_fail_the_next_round() -> None:
    handler = get_rendezvous_handler("memory://corrupt-history?nnodes=1&join_timeout=30")
    try:
        assert handler.next_rendezvous().rank == 0
        store = handler._store  # type: ignore[attr-defined]
        key = round_event_key(RunKeys("corrupt-history"), 0)
        record = json.loads(store.get(key))
        record["fields"] = {"members": [["x"]]}
        store.set(key, json.dumps(record))
        info = handler.next_rendezvous()  # round 1 forms, its event written
        assert info.world_size == 1
        event = decode_event("k", store.get(round_event_key(RunKeys("corrupt-history"), 1)))
        assert event.fields["cause"] == "initial"  # the previous round is unknown
    finally:
        handler.shutdown()


def test_leave_marks_round_trip_and_garbage_reads_as_lost() -> None:
    assert decode_left_mark(encode_left_mark("graceful_leave")) == "graceful_leave"
    assert decode_left_mark(b"\xff garbage") == "lost"
    assert decode_left_mark(b'{"reason": "bored"}') == "lost"
    with pytest.raises(ValueError, match="unknown leave reason"):
        encode_left_mark("bored")


@pytest.mark.parametrize("count, limit, deleted", [
    (100, 100, 0),
    (116, 100, 0),            # within the slack: nothing to do yet
    (117, 100, 17),           # past it: back to the newest 100
    (11_000, 10_000, 0),
    (11_001, 10_000, 1001),
    (16, 0, 0),               # limit 0: within the minimum slack of 16
    (17, 0, 17),              # past it: none kept
])
def test_prune_plan_counts(count: int, limit: int, deleted: int) -> None:
    seqs = {f"k{i:06d}": i for i in range(count)}
    plan = prune_plan(seqs, limit)
    assert len(plan) == deleted
    assert plan == sorted(seqs, key=seqs.__getitem__)[:deleted]  # the oldest go


def test_prune_plan_deletes_corrupt_records_first() -> None:
    seqs: dict[str, int | None] = {f"k{i}": i for i in range(200)}
    seqs["zz-corrupt"] = None
    plan = prune_plan(seqs, 100)
    assert plan[0] == "zz-corrupt" and len(plan) == 101
    assert prune_slack(10_000) == 1000 and prune_slack(100) == 16


@pytest.mark.parametrize("kind, node, rnd, fields, text", [
    ("round_formed", "h:1:0badcafe", 3,
     {"world_size": 3, "members": ["a", "b", "c:7:deadbeef"], "newcomers": ["c:7:deadbeef"],
      "left": [{"node": "b:2:12345678", "reason": "heartbeat_missed"}], "formation_s": 0.008,
      "cause": "loss"},
     "round 3   formed in 8 ms: 3 node(s) (+c:7; b:2 left: heartbeat missed)"),
    ("round_formed", "h:1:0badcafe", 0,
     {"world_size": 2, "members": ["a", "b"], "newcomers": ["a", "b"], "left": [],
      "formation_s": 1.5, "cause": "initial"},
     "round 0   formed in 1.50 s: 2 node(s)"),
    ("worker_failed", "h:1:0badcafe", 2,
     {"rank": 5, "exit_code": 1, "error": "ValueError: boom"},
     "round 2   h:1: worker rank 5 failed with exit code 1: ValueError: boom"),
    ("worker_failed", "h:1:0badcafe", 2, {"rank": 5, "signal": "SIGKILL"},
     "round 2   h:1: worker rank 5 failed with signal SIGKILL"),
    ("node_leaving", "h:1:0badcafe", 2, {}, "round 2   h:1 leaving gracefully"),
    ("training_paused", "h:1:0badcafe", 4, {"pause_s": 75.2, "cause": "worker_failed"},
     "round 4   h:1 training paused 1 min 15 s (worker failed)"),
    ("switched_in_process", "h:1:0badcafe", 4, {"pause_s": 0.042, "step": 120},
     "round 4   h:1 switched in-process in 42 ms at step 120"),
    ("run_closed", "h:1:0badcafe", None, {"reason": "workers_succeeded"},
     "          run closed by h:1 (workers succeeded)"),
    ("from_the_future", "h:1:0badcafe", None, {"x": 1},
     '          from_the_future h:1 {"x": 1}'),
])
def test_format_event(kind: str, node: str, rnd: int | None, fields: dict[str, Any],
                      text: str) -> None:
    stamp = datetime(2026, 11, 25, 23, 41, 7, 120000).timestamp()
    line = format_event(RunEvent(1, stamp, kind, rnd, node, fields))
    assert line == "23:41:07.120  " + text


@pytest.mark.parametrize("kind, fields", [
    ("round_formed", {"newcomers": 5, "cause": "join"}),
    ("round_formed", {"left": "x", "formation_s": 1e300, "world_size": [1]}),
    ("round_formed", {"left": [{"node": 1, "reason": None}, 3], "newcomers": [None, 4]}),
    ("round_formed", {"formation_s": 10 ** 400}),
    ("worker_failed", {"signal": {"a": 1}, "error": ["x"], "rank": None}),
    ("node_lost", {"lost": 5, "silent_s": -3, "reason": 1}),
    ("training_paused", {"pause_s": "1", "cause": 2}),
    ("switched_in_process", {"step": {}, "pause_s": [1]}),
    ("run_closed", {"reason": 7}),
    ("something_new", {"x": [1, {"y": None}]}),
])
def test_format_event_never_fails_on_field_types(kind: str, fields: dict[str, Any]) -> None:
    for stamp in (1.5, 1e20, float("nan"), float("inf")):  # (a Python caller's, not decoded)
        line = format_event(RunEvent(1, stamp, kind, 3, "a:1:0badcafe", fields), utc=True)
        assert "round 3" in line and "\n" not in line


def test_short_node_and_seconds() -> None:
    assert short_node("10.0.0.1:4242:0badcafe") == "10.0.0.1:4242"
    assert short_node("::1:4242:0badcafe") == "::1:4242"
    assert short_node("host:4242") == "host:4242"
    assert short_node(None) == "?"
    assert [format_seconds(s) for s in (0.0004, 0.25, 2.5, 125, "x")] == \
        ["0 ms", "250 ms", "2.50 s", "2 min 5 s", "?"]
    assert [format_seconds(s) for s in (float("nan"), float("inf"), -1, 1e300, 10 ** 400,
                                        True, None)] == ["?"] * 7


NOW = datetime(2026, 11, 25, 23, 50, 0).timestamp()


@pytest.mark.parametrize("text, expected", [
    ("10m", NOW - 600), ("90s", NOW - 90), ("90", NOW - 90), ("2h", NOW - 7200),
    ("1d", NOW - 86400), ("1.5m", NOW - 90), ("250ms", NOW - 0.25),
    ("23:40", datetime(2026, 11, 25, 23, 40).timestamp()),
    ("23:40:07", datetime(2026, 11, 25, 23, 40, 7).timestamp()),
    ("2026-11-24T08:00:00", datetime(2026, 11, 24, 8).timestamp()),
    ("2026-11-24 08:00", datetime(2026, 11, 24, 8).timestamp()),
    ("@1764114000", 1764114000.0),
])
def test_parse_since(text: str, expected: float) -> None:
    assert parse_since(text, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["yesterday", "10 parsecs", "-5m", "25:99", "@x"])
def test_parse_since_rejects_with_examples(text: str) -> None:
    with pytest.raises(ValueError, match="neither a duration"):
        parse_since(text, NOW)


def _record(**values: Any) -> bytes:
    """A valid event record (``values`` override its own)."""
    record = {"v": 1, "t": "event", "seq": 7, "time": 1.5, "kind": "round_formed", "round": 0,
              "node": "a", "fields": {}, **values}
    return json.dumps(record, separators=(",", ":")).encode()


@pytest.mark.parametrize("raw, problem", [
    (b"\x00\xff", "does not hold JSON"),
    (b"[1, 2]", "not an event"),
    (b'{"v": 2, "t": "event"}', "format version 2"),
    (b'{"v": 1, "t": "event", "seq": -1, "time": "x", "kind": "", "round": "3", '
     b'"node": 7, "fields": []}',
     "seq -1 is not a non-negative 64-bit integer; time 'x' is not unix seconds; kind '' is "
     "not a name; round '3' is not an integer; node 7 is not a string; fields '[]' is not an "
     "object"),
    (_record(time=1e20), "time 1e+20 is not unix seconds"),
    (_record(time=-5), "time -5 is not unix seconds"),
    (_record(seq=1 << 64), f"seq {1 << 64} is not a non-negative 64-bit integer"),
    (_record().replace(b'"time":1.5', b'"time":NaN'), "NaN is not a number JSON allows"),
    (_record().replace(b'"time":1.5', b'"time":Infinity'), "Infinity is not a number JSON"),
    (_record(fields={"formation_s": "X"}).replace(b'"X"', b"1e400"), "1e400 is out of range"),
    (_record(fields={"a": [{"b": "X"}]}).replace(b'"X"', b"-Infinity"), "-Infinity is not"),
])
def test_decode_event_names_what_is_wrong(raw: bytes, problem: str) -> None:
    from rdzv.errors import RendezvousStateError

    with pytest.raises(RendezvousStateError, match="history key 'k'") as info:
        decode_event("k", raw)
    assert problem in str(info.value)


def test_new_event_checks_its_kind_and_stamps_increase() -> None:
    with pytest.raises(ValueError, match="unknown event kind"):
        new_event("node_wandering")
    stamps = [new_event("run_closed").seq for _ in range(1000)]
    assert stamps == sorted(set(stamps))
    event = new_event("node_lost", round=3, node="n", lost="m", silent_s=None)
    assert decode_event("k", encode_event(event)) == event
    assert "silent_s" not in event.fields  # unknown values are left out


# -- the reader and the writer on a real store server ------------------------------------------
def test_corrupt_events_are_reported_and_skipped(server: Any, tmp_path: Any) -> None:
    store = client(server)
    writer = EventWriter(store, "job", tag="t")
    writer.record("node_waiting", round=0, node="a:1:0badcafe")
    writer.record("run_closed", node="a:1:0badcafe", reason="workers_succeeded")
    assert writer.flush()
    directory = events_dir(RunKeys("job"))
    store.set(directory + "e0000000000000005.x", b"{not json")
    store.set(directory + "e0000000000000006.x", json.dumps({"v": 9, "t": "event"}))
    log = read_events(store, "job")
    assert [e.kind for e in log.events] == ["node_waiting", "run_closed"]
    assert len(log.corrupt) == 2 and "does not hold JSON" in log.corrupt[0]
    assert "version 9" in log.corrupt[1]
    assert read_events(store, "job", since_seq=log.next_seq).events == []

    result = rdzv_cli("status", f"tcp://127.0.0.1:{server.port}/job", "--events")
    assert result.returncode == 0
    assert "waiting to join" in result.stdout and "run closed by a:1" in result.stdout
    assert result.stderr.count("skipped a corrupt event") == 2
    assert "e0000000000000005.x" in result.stderr
    as_json = rdzv_cli("status", f"tcp://127.0.0.1:{server.port}/job", "--events", "--json")
    assert [json.loads(line)["kind"] for line in as_json.stdout.splitlines()] == \
        ["node_waiting", "run_closed"]
    writer.close()
    store.close()


def test_history_stays_bounded_over_a_hundred_times_its_size(server: Any) -> None:
    """10,000 events into a history of 100: the pruning that bounds a long run's history,
    the same at any size (it used to be 100,000 into 1,000, 40 s of the suite)."""
    store, limit, events = client(server), 100, 10_000
    writer = EventWriter(store, "job", tag="t", limit=limit)
    directory = events_dir(RunKeys("job"))
    most = 0
    for i in range(events):
        writer.record("node_waiting", round=i, node="a:1:0badcafe")
        if i % 50 == 49:
            assert writer.flush(60)
            most = max(most, store.count_keys(directory))
    assert writer.flush(60) and writer.dropped == 0
    assert most <= limit + prune_slack(limit) + EventWriter.BATCH
    log = read_events(store, "job")
    assert limit <= len(log.events) <= limit + prune_slack(limit)
    assert log.events[-1].round == events - 1  # the newest are kept
    assert [e.round for e in log.events] == sorted(e.round for e in log.events)
    writer.close()
    store.close()


def test_a_store_that_is_gone_loses_events_not_the_writer(server: Any) -> None:
    store = client(server)
    writer = EventWriter(store, "job", tag="t")
    store.close()  # gone: every write fails
    for _ in range(10):
        assert writer.record("node_waiting") is not None
    assert writer.flush(30)
    assert writer.dropped == 10
    writer.close()
    assert writer.record("node_waiting") is None  # closed: records nothing


def test_history_size_zero_records_nothing(server: Any) -> None:
    url = f"tcp://127.0.0.1:{server.port}/job?nnodes=1&is_host=0&history_size=0"
    handler = get_rendezvous_handler(url)
    handler.next_rendezvous()
    handler.record_event("run_closed")  # type: ignore[attr-defined]
    handler.shutdown()
    store = client(server)
    assert store.count_keys(events_dir(RunKeys("job"))) == 0
    store.close()


def test_the_seal_writes_the_round_event() -> None:
    """The round event comes with the seal, the nodes' own events after."""
    with StoreServer("127.0.0.1", 0) as server:
        url = f"tcp://127.0.0.1:{server.port}/job?min_nodes=2&max_nodes=2&is_host=0"
        handlers = [get_rendezvous_handler(url) for _ in range(2)]
        threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        store = client(server)
        raw = store.try_get(round_event_key(RunKeys("job"), 0))
        assert raw is not None
        event = decode_event("k", raw)
        assert event.fields["world_size"] == 2
        assert sorted(event.fields["members"]) == sorted(h.node_id for h in handlers)
        for handler in handlers:
            handler.shutdown()  # writes the deferred arrivals
        kinds = [e.kind for e in read_events(store, "job").events]
        assert kinds.count("node_waiting") == 2 and kinds.count("round_formed") == 1
        store.close()


def test_a_store_that_refuses_history_writes_fails_no_rendezvous() -> None:
    with StoreServer("127.0.0.1", 0, max_frame_size=64 << 10) as server:
        url = f"tcp://127.0.0.1:{server.port}/job?nnodes=1&is_host=0"
        handler = get_rendezvous_handler(url)
        for _ in range(3):
            handler.next_rendezvous()
        # an event past the server's frame limit (and the 4 KiB an event may take): dropped
        handler.record_event("node_lost", lost="x" * (1 << 20))  # type: ignore[attr-defined]
        assert handler.history.flush(30)  # type: ignore[attr-defined]
        assert handler.history.dropped >= 1  # type: ignore[attr-defined]
        info = handler.next_rendezvous()  # the rendezvous goes on
        assert info.world_size == 1
        handler.shutdown()


@pytest.mark.parametrize("argv, message", [
    (["--follow"], "--since and --follow go with --events"),
    (["--since", "10m"], "--since and --follow go with --events"),
    (["--events", "--watch"], "--events takes --follow, not --watch"),
    (["--events", "--since", "yesterday"], "is neither a duration (10m, 90s, 2h, 1d)"),
])
def test_status_events_usage_errors(server: Any, argv: list[str], message: str) -> None:
    result = rdzv_cli("status", f"tcp://127.0.0.1:{server.port}/job", *argv)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_status_events_of_a_run_without_history(server: Any) -> None:
    with TCPStore("127.0.0.1", server.port, is_master=False, timeout=10) as store:
        store.set("rdzv/job/sealed", b"0")  # a run whose nodes keep no history
    result = rdzv_cli("status", f"tcp://127.0.0.1:{server.port}/job", "--events")
    assert (result.returncode, result.stdout) == (0, "run job: no events\n")
    as_json = rdzv_cli("status", f"tcp://127.0.0.1:{server.port}/job", "--events", "--json")
    assert (as_json.returncode, as_json.stdout) == (0, "")


# -- corrupt values, late writes, a writer that survives anything, one pruner at a time ---------
def _strict_json(line: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_status_events_skips_non_finite_records_and_prints_odd_fields(server: Any) -> None:
    store = client(server)
    directory = events_dir(RunKeys("job"))
    store.set(directory + "e0000000000000001.x", _record(time=1e20))
    store.set(directory + "e0000000000000002.x", _record().replace(b'"time":1.5', b'"time":NaN'))
    store.set(directory + "e0000000000000003.x",
              _record(fields={"formation_s": "X"}).replace(b'"X"', b"1e400"))
    store.set(directory + "e0000000000000004.x",
              _record(seq=4, fields={"newcomers": 5, "left": "x", "formation_s": 10 ** 30}))
    store.set(directory + "e0000000000000005.x",
              _record(seq=5, kind="node_lost", fields={"lost": 5, "silent_s": "long"}))
    url = f"tcp://127.0.0.1:{server.port}/job"
    text = rdzv_cli("status", url, "--events")
    assert text.returncode == 0, text.stderr
    assert text.stderr.count("skipped a corrupt event") == 3
    assert "not unix seconds" in text.stderr and "NaN" in text.stderr and "1e400" in text.stderr
    lines = text.stdout.splitlines()
    assert len(lines) == 2 and '"newcomers": 5' in lines[0] and "lost" in lines[1]
    as_json = rdzv_cli("status", url, "--events", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert [_strict_json(line)["seq"] for line in as_json.stdout.splitlines()] == [4, 5]
    store.close()


def test_a_follower_gets_a_write_that_lands_late(server: Any) -> None:
    """A write whose stamp is older than what the follower already read (a slow write, a host
    whose clock lags) still comes, once; ``since_seq`` keeps working for older callers."""
    store = client(server)
    directory = events_dir(RunKeys("job"))
    late = new_event("node_waiting", node="late:1")       # stamped first ...
    early = new_event("node_leaving", node="early:2")
    store.set(directory + f"e{early.seq:016d}.b", encode_event(early))
    first = read_events(store, "job")
    assert [e.node for e in first.events] == ["early:2"]
    store.set(directory + f"e{late.seq:016d}.a", encode_event(late))  # ... written last
    second = read_events(store, "job", after=first)
    assert [e.node for e in second.events] == ["late:1"]
    assert read_events(store, "job", after=second).events == []
    assert second.keys == {directory + f"e{early.seq:016d}.b", directory + f"e{late.seq:016d}.a"}
    # the older poll: by seq
    assert [e.node for e in read_events(store, "job", since_seq=late.seq).events] == ["early:2"]
    assert read_events(store, "job", since_seq=early.seq).events == []
    # the cursor forgets what was pruned
    store.delete_key(directory + f"e{early.seq:016d}.b")
    assert read_events(store, "job", after=second).keys == {directory + f"e{late.seq:016d}.a"}
    store.close()


def test_a_deferred_event_is_checked_when_written_and_only_it_is_dropped(
    server: Any, caplog: Any
) -> None:
    store = client(server)
    writer = EventWriter(store, "job", tag="t")
    assert writer.record("node_waiting", node="a", defer=True) is not None
    assert writer.record("node_lost", silent_s=float("nan"), defer=True) is not None
    assert writer.dropped == 0  # (not encoded while the node joins its round)
    writer.release()
    assert writer.flush(10) and writer.dropped == 1
    assert [e.kind for e in read_events(store, "job").events] == ["node_waiting"]
    assert "event 'node_lost' not recorded" in caplog.text
    writer.close(5)
    store.close()


def test_the_writer_drops_what_it_cannot_record_and_lives_on(server: Any, caplog: Any) -> None:
    store = client(server)
    opened: list[int] = []

    def flaky() -> TCPStore:  # the first opening fails with an error that is no store error
        opened.append(1)
        if len(opened) == 1:
            raise RuntimeError("a bug in a store factory")
        return store

    writer = EventWriter(flaky, "job", tag="t")
    assert writer.record("node_wandering") is None                       # unknown kind
    assert writer.record("node_lost", lost=object()) is None             # not JSON
    assert writer.record("node_lost", silent_s=float("nan")) is None     # not finite
    assert writer.record("node_lost", lost="x" * MAX_EVENT_BYTES) is None  # too large
    assert writer.dropped == 4
    assert writer.record("node_waiting", node="a") is not None
    assert writer.flush(10) and writer.dropped == 5                      # the factory failed
    assert writer.record("run_closed", node="a") is not None
    assert writer.flush(10) and writer.dropped == 5                      # the thread lives on
    assert [e.kind for e in read_events(store, "job").events] == ["run_closed"]
    assert "RuntimeError: a bug in a store factory" in caplog.text
    assert "node_wandering" in caplog.text and "not JSON serializable" in caplog.text
    writer.close(5)
    store.close()


@pytest.mark.parametrize("marker, takes", [
    (None, True),
    (b'{"until": 0}', True),                  # given back
    (b'{"holder": "b", "until": 99.0}', True),   # its holder died: the lease ran out
    (b'{"holder": "b", "until": 101.0}', False),
    (b"garbage", True),
    (b'{"until": "later"}', True),
])
def test_prune_marker_may_be_taken(marker: bytes | None, takes: bool) -> None:
    assert may_take(marker, 100.0) is takes


def test_one_writer_prunes_at_a_time(server: Any) -> None:
    store, limit = client(server), 100  # slack 16
    directory = events_dir(RunKeys("job"))
    marker = RunKeys("job").base + "history_prune"
    held = json.dumps({"holder": "other", "until": time.time() + 60}).encode()
    writer = EventWriter(store, "job", tag="t", limit=limit)
    store.set(marker, held)
    for i in range(120):
        writer.record("node_waiting", round=i)
    assert writer.flush(30)
    assert store.count_keys(directory) == 120  # another writer holds the marker: it prunes
    store.set(marker, json.dumps({"holder": "other", "until": 0}))  # given back
    writer.record("node_waiting", round=120)
    assert writer.flush(30)
    assert store.count_keys(directory) == limit
    assert may_take(store.try_get(marker), time.time())  # given back after pruning
    # past twice the slack, a writer prunes even while another holds the marker
    store.set(marker, held)
    for i in range(40):
        writer.record("node_waiting", round=200 + i)
        assert writer.flush(30)
    assert store.count_keys(directory) <= limit + 2 * prune_slack(limit)
    assert store.try_get(marker) == held  # (not its to give back)
    writer.close()
    store.close()


def test_the_default_bound_holds_with_concurrent_writers(server: Any) -> None:
    """Four writers, each on its own connection, write 14,000 events together as fast as they
    can: the history stays within the default bound (at most twice the slack, plus a batch a
    writer, while the writers outpace one pruner) and keeps the newest."""
    limit, writers_n, each = DEFAULT_HISTORY_SIZE, 4, 3500
    stores = [client(server) for _ in range(writers_n)]
    writers = [EventWriter(s, "job", tag=f"w{i}") for i, s in enumerate(stores)]
    directory = events_dir(RunKeys("job"))
    observer = client(server)
    most = 0

    def write(i: int) -> None:
        for n in range(each):
            writers[i].record("node_waiting", round=n, node=f"w{i}")
            if n % 500 == 499:
                writers[i].flush(60)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers_n)]
    since = observer.revision(directory)
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):  # a sample after every change
        most = max(most, observer.count_keys(directory))
        since = max(since, observer.watch(directory, since, 0.2))
    most = max(most, observer.count_keys(directory))
    for thread in threads:
        thread.join(60)
    assert all(w.flush(60) for w in writers) and sum(w.dropped for w in writers) == 0
    bound = limit + 2 * prune_slack(limit) + writers_n * EventWriter.BATCH
    assert most <= bound
    log = read_events(observer, "job")
    assert limit <= len(log.events) <= bound and not log.corrupt
    for i in range(writers_n):  # each writer's newest events are kept
        assert max(e.round for e in log.events if e.node == f"w{i}") == each - 1  # type: ignore
    for writer in writers:
        writer.close()
    for store in [*stores, observer]:
        store.close()
