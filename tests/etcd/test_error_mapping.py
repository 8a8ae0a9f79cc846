"""etcd's error answers (unary and stream shapes) become rdzv's typed errors or retries."""

from __future__ import annotations

import pytest

from rdzv.errors import (
    SessionExpiredError,
    StoreAuthenticationError,
    StoreError,
    StoreProtocolError,
    StoreValueError,
)
from rdzv.etcd._client import EtcdCompactedError, _decode, _InvalidToken, _raise_error, _Transient

UNARY = [
    ({"code": 14, "message": "etcdserver: no leader"}, _Transient),
    ({"code": 4, "message": "etcdserver: request timed out"}, _Transient),
    ({"code": 8, "message": "etcdserver: too many requests"}, _Transient),
    ({"code": 16, "message": "etcdserver: invalid auth token"}, _InvalidToken),
    (
        {"code": 3, "message": "etcdserver: authentication failed, invalid user ID or password"},
        StoreAuthenticationError,
    ),  # fmt: skip
    ({"code": 3, "message": "etcdserver: user name is empty"}, StoreAuthenticationError),
    ({"code": 7, "message": "etcdserver: permission denied"}, StoreAuthenticationError),
    ({"code": 5, "message": "etcdserver: requested lease not found"}, SessionExpiredError),
    ({"code": 11, "message": "mvcc: required revision has been compacted"}, EtcdCompactedError),
    ({"code": 3, "message": "etcdserver: duplicate key given in txn request"}, StoreValueError),
    ({"code": 2, "message": "something else"}, StoreError),
]


@pytest.mark.parametrize("answer, error", UNARY)
def test_unary_errors(answer: dict, error: type) -> None:
    with pytest.raises(error):
        _raise_error("h:1", "kv/put", answer)


def test_stream_error_shape_is_understood() -> None:
    answer = {"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader"}}
    with pytest.raises(_Transient, match="no leader"):
        _raise_error("h:1", "watch", answer)


def test_error_names_endpoint_and_request() -> None:
    with pytest.raises(StoreError, match=r"etcd at h:1 rejected kv/range: something else"):
        _raise_error("h:1", "kv/range", {"code": 2, "message": "something else"})


def test_non_json_answers() -> None:
    with pytest.raises(StoreProtocolError, match="protocol=https"):
        _decode("h:1", "kv/range", 400, b"Client sent an HTTP request to an HTTPS server.")
    with pytest.raises(StoreProtocolError, match="etcd >= 3.4"):
        _decode("h:1", "kv/range", 404, b"404 page not found")
