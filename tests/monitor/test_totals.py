"""The fold of a run's events into its metrics' totals, and the server's fixed-bucket histogram,
as tables (no I/O)."""

from __future__ import annotations

import pytest

from rdzv.monitor import RunTotals, parse_web_address
from rdzv._address import is_loopback
from rdzv.monitor._cli import page_secret
from rdzv.monitor._http import host_names_this_machine
from rdzv.errors import RendezvousParameterError
from rdzv.rendezvous import RunEvent
from rdzv.server._metrics import Histogram


def event(seq: int, kind: str, **fields: object) -> RunEvent:
    return RunEvent(seq, 1000.0 + seq, kind, None, None, dict(fields))


def test_events_add_up_by_kind_and_cause() -> None:
    totals = RunTotals()
    totals.add([
        event(1, "round_formed", cause="initial", formation_s=0.02, world_size=2),
        event(2, "round_formed", cause="join", formation_s=0.3),
        event(3, "worker_failed", rank=1, exit_code=1),
        event(4, "training_paused", pause_s=2.0, cause="membership_change"),
        event(5, "switched_in_process", pause_s=0.4),
        event(6, "round_formed", formation_s=True),   # no cause, a bool is no duration
        event(7, "node_waiting"),
    ], corrupt=2)
    assert totals.rounds == {"initial": 1, "join": 1, "unknown": 1}
    assert totals.events == {"round_formed": 3, "worker_failed": 1, "training_paused": 1,
                             "switched_in_process": 1, "node_waiting": 1}
    assert totals.formation.snapshot().count == 2
    assert totals.formation.snapshot().sum == pytest.approx(0.32)
    assert {cause: h.snapshot().count for cause, h in totals.pauses.items()} == \
        {"membership_change": 1, "switched_in_process": 1}
    assert totals.worker_failures == 1 and totals.corrupt == 2


def test_restart_fallbacks_add_up_by_cause() -> None:
    totals = RunTotals()
    totals.add([
        event(1, "restart_fallback", cause="worker_failed", reason="rank 3: exit code 1"),
        event(2, "restart_fallback", cause="not_inprocess"),
        event(3, "restart_fallback", cause="worker_failed"),
        event(4, "restart_fallback", cause="rm -rf"),  # not a cause: no new series
        event(5, "restart_fallback"),
    ])
    assert totals.fallbacks == {"worker_failed": 2, "not_inprocess": 1, "other": 1,
                                "unknown": 1}
    assert totals.events == {"restart_fallback": 5}


def test_labels_take_only_known_kinds_and_causes() -> None:
    """Label values come from the history, which anyone with the store can write: each one is a
    time series, so values outside the known ones count under ``other``."""
    totals = RunTotals()
    totals.add([
        event(1, "round_formed", cause="x" * 300, formation_s=0.1),
        event(2, "round_formed", cause="join"),
        event(3, "made_up_kind"),
        event(4, "training_paused", pause_s=1.0, cause={"a": 1}),
        event(5, "training_paused", pause_s=1.0, cause="membership_change"),
        event(6, "recovered_in_process", pause_s=0.2),
    ])
    assert totals.rounds == {"other": 1, "join": 1}
    assert totals.events == {"round_formed": 2, "other": 1, "training_paused": 2,
                             "recovered_in_process": 1}
    assert sorted(totals.pauses) == ["membership_change", "other", "recovered_in_process"]


@pytest.mark.parametrize("header, answered", [
    ("127.0.0.1:8080", True), ("localhost:8080", True), ("localhost", True),
    ("[::1]:8080", True), ("[::1]", True), ("LocalHost:8080", True), ("10.0.0.5:8080", True),
    ("evil.example:8080", False), ("evil.example", False), ("127.0.0.1:8081", False),
    ("127.0.0.1.nip.io:8080", False), ("[::1]x", False), ("", False), (None, False),
])
def test_host_headers_answered_on_loopback(header: str | None, answered: bool) -> None:
    # (10.0.0.5: the address the page is bound to in this table)
    assert host_names_this_machine(header, "10.0.0.5", 8080) is answered


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.0.1", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("node0", False),
])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_pages_password(tmp_path: pytest.TempPathFactory) -> None:
    assert page_secret(("127.0.0.1", 8080), None, None) is None
    assert page_secret(("0.0.0.0", 8080), b"store", None) == b"store"
    path = tmp_path / "web"  # type: ignore[operator]
    path.write_bytes(b"page\n")
    assert page_secret(("0.0.0.0", 8080), b"store", str(path)) == b"page"
    with pytest.raises(RendezvousParameterError, match="--web-secret-file"):
        page_secret(("0.0.0.0", 8080), None, None)
    with pytest.raises(RendezvousParameterError, match="--web-secret-file"):
        page_secret(("127.0.0.1", 8080), None, str(tmp_path / "missing"))  # type: ignore[operator]


@pytest.mark.parametrize("value, bucket", [
    (0.0, 0), (0.001, 0), (0.0011, 1), (0.01, 1), (0.5, 2), (1.0, 2), (1.5, 3), (1e9, 3),
])
def test_a_value_lands_in_the_first_bucket_at_or_above_it(value: float, bucket: int) -> None:
    histogram = Histogram((0.001, 0.01, 1.0))
    histogram.observe(value, 3)
    counts = histogram.snapshot().counts
    assert counts[bucket] == 3 and sum(counts) == 3
    assert histogram.snapshot().cumulative()[-1] == (float("inf"), 3)


def test_bucket_bounds_must_increase() -> None:
    with pytest.raises(ValueError):
        Histogram((1.0, 0.5))


@pytest.mark.parametrize("text, address", [
    ("8080", ("127.0.0.1", 8080)),
    ("0.0.0.0:9000", ("0.0.0.0", 9000)),
    ("[::1]:8080", ("::1", 8080)),
    ("node0:0", ("node0", 0)),
])
def test_web_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_web_address(text) == address


@pytest.mark.parametrize("text", ["", "host", "host:port", "1:2:3:x", "99999"])
def test_malformed_web_addresses(text: str) -> None:
    with pytest.raises(RendezvousParameterError, match=r"\[HOST:\]PORT"):
        parse_web_address(text)
