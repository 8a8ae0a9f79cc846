"""The versioned JSON records of the rendezvous state: round trips and clear errors for bad data."""

from __future__ import annotations

import pytest

from rdzv.errors import RendezvousStateError
from rdzv.rendezvous._layout import (
    CLOSED_STATUS,
    Decision,
    JoinerKey,
    NodeDescriptor,
    RunKeys,
    control_dir_round,
    decode_int,
    decode_node,
    decode_rank,
    decode_status,
    encode_decision,
    encode_node,
    encode_ranks,
    seal_of,
    is_sealer_lock,
    parse_joiner_key,
)

KEY = "rdzv/job/round/0/x"


def test_round_trips():
    node = NodeDescriptor("n1", "10.0.0.1", 42, 29500, 3)
    assert decode_node(KEY, encode_node(node)) == node
    decision = Decision(4, "10.0.0.1", 29500)
    assert decode_status(KEY, encode_decision(decision)) == decision
    assert decode_status(KEY, CLOSED_STATUS) is True
    assert decode_status(KEY, None) is None
    records = encode_ranks({"a": 3, "b": 0}, decision)
    assert decode_rank(KEY, records["a"]) == (3, decision)
    assert decode_rank(KEY, records["b"]) == (0, decision)
    quoted = Decision(2, 'host "x"\\', 1)  # the shared part is JSON-escaped like the rest
    assert decode_rank(KEY, encode_ranks({"a": 1}, quoted)["a"]) == (1, quoted)


def test_a_decision_carries_its_seal_in_its_status_and_every_rank_record():
    seal = seal_of("sealer:1:ab", {"a": 0, "b": 1}, "10.0.0.1", 29500)
    decision = Decision(2, "10.0.0.1", 29500, seal)
    assert decode_status(KEY, encode_decision(decision)) == decision
    assert {decode_rank(KEY, raw)[1] for raw in encode_ranks({"a": 0, "b": 1}, decision).values()} \
        == {decision}
    # The seal tells two decisions apart even when they agree on size and address.
    assert seal != seal_of("other:2:cd", {"a": 0, "b": 1}, "10.0.0.1", 29500)
    assert seal != seal_of("sealer:1:ab", {"a": 1, "b": 0}, "10.0.0.1", 29500)
    assert seal == seal_of("sealer:1:ab", {"b": 1, "a": 0}, "10.0.0.1", 29500)
    # Records written before fencing (no seal) still read, with an empty seal.
    old = b'{"v":2,"t":"rank","rank":1,"world_size":2,"addr":"h","port":1}'
    assert decode_rank(KEY, old) == (1, Decision(2, "h", 1, ""))


@pytest.mark.parametrize(
    "decode, raw, says",
    [
        (decode_node, b"\x80\x03pickle", "does not hold rdzv JSON"),
        (decode_node, b'{"v": 1, "t": "node"}', "not a version 2 'node' record"),
        (decode_node, b'{"v": 2, "t": "sealed", "world_size": 1}', "'node' record"),
        (decode_node, b'{"v":2,"t":"node","id":"a","host":"h","pid":"1","port":1}', "'pid'"),
        (decode_status, b"[1, 2]", "not a version 2"),
        (decode_status, b'{"v":2,"t":"sealed","world_size":0,"addr":"h","port":1}',
         "world_size 0"),
        (decode_rank, b'{"v":2,"t":"rank","rank":4,"world_size":4,"addr":"h","port":1}',
         "rank 4 outside 0..3"),
        (decode_rank, b'{"v":2,"t":"rank","rank":true,"world_size":4,"addr":"h","port":1}',
         "'rank' must be int"),
    ],
)
def test_bad_records_name_the_key(decode, raw, says):
    with pytest.raises(RendezvousStateError) as info:
        decode(KEY, raw)
    assert KEY in str(info.value) and says in str(info.value)


def test_counters_and_run_ids():
    assert decode_int(KEY, None, -1) == -1
    assert decode_int(KEY, b"7", -1) == 7
    with pytest.raises(RendezvousStateError, match="must hold an integer"):
        decode_int(KEY, b"seven", -1)
    for bad in ("", "a/b", "a b"):
        with pytest.raises(ValueError, match="run_id"):
            RunKeys(bad)
    keys = RunKeys("job")
    assert keys.expect(1, "h:7:ab12cd34") == "rdzv/job/round/1/ctl/expect/h:7:ab12cd34"
    assert keys.rank(1, "h:7:ab12cd34") == "rdzv/job/round/1/rank/h:7:ab12cd34"
    assert keys.status(0).startswith(keys.ctl(0))


def test_taking_the_sealer_lock_wakes_no_waiting_node():
    keys = RunKeys("job")
    assert not keys.sealer(3).startswith(keys.ctl(3)), "waiting nodes watch ctl/"
    assert keys.status(3).startswith(keys.ctl(3)) and keys.armed(3).startswith(keys.ctl(3))


def test_the_etcd_backend_recognises_the_keys_run_keys_builds() -> None:
    keys = RunKeys("job")
    node = parse_joiner_key(keys.node(3, "h:1:ab"))
    assert node == JoinerKey(keys.round(3), "nodes", "h:1:ab")
    assert node is not None and node.rank_key == keys.rank(3, "h:1:ab")
    assert parse_joiner_key(keys.back(3, "h:1:ab")) == JoinerKey(keys.round(3), "back", "h:1:ab")
    assert parse_joiner_key(keys.expect(4, "x")) == JoinerKey(keys.round(4), "expect", "x")
    for other in (keys.rank(3, "x"), keys.status(3), keys.sealer(3), keys.nodes(3),
                  keys.user(3) + "/nodes/x", keys.sealed, "nodes/x"):
        assert parse_joiner_key(other) is None, other
    assert is_sealer_lock(keys.sealer(0)) and not is_sealer_lock(keys.sealer(0) + "x")
    assert not is_sealer_lock(keys.user(0) + "/sealer")
    assert control_dir_round(keys.ctl(7)) == keys.round(7)
    assert control_dir_round(keys.expect_dir(7)) is None
    assert control_dir_round(keys.round(7)) is None
