"""HOST:PORT endpoints (rdzv._address): torch's parse_rendezvous_endpoint rules, as a table.

tests/torch/test_dropin.py runs torch's own parser on the same kind of input next to this one.
"""

from __future__ import annotations

import pytest

from rdzv._address import check_host, check_port, parse_endpoint
from rdzv.errors import RendezvousParameterError


@pytest.mark.parametrize(
    "endpoint, default, expected",
    [
        ("", 29400, ("localhost", 29400)),
        ("  ", 29400, ("localhost", 29400)),
        (None, 29400, ("localhost", 29400)),
        ("node-0", 29400, ("node-0", 29400)),
        ("node-0.cluster.local.:7", 29400, ("node-0.cluster.local.", 7)),
        ("10.0.0.1:0", 29400, ("10.0.0.1", 0)),
        ("h:65535", None, ("h", 65535)),
        ("[::1]", 29400, ("::1", 29400)),
        ("[::1]:5", None, ("::1", 5)),
        ("::1", 29400, ("::1", 29400)),
        ("under_score", 1, ("under_score", 1)),
    ],
)
def test_well_formed_endpoints(endpoint: str, default: int | None, expected: tuple) -> None:
    assert parse_endpoint(endpoint, default) == expected


@pytest.mark.parametrize(
    "endpoint, default, message",
    [
        ("host:", 29400, "The port number of the rendezvous endpoint 'host:' must be an integer"),
        ("host:port", 29400, "The port number of"),
        ("host:65536", 29400, "The port number of"),
        ("host:-1", 29400, "The port number of"),
        ("host", None, "The port number of"),
        ("", None, "The port number of"),
        ("~", 29400, "The hostname of the rendezvous endpoint '~' must be a dot-separated list"),
        ("dummy.com :123", 29400, "The hostname of"),
        (":123", 29400, "The hostname of"),
        ("a..b:1", 29400, "The hostname of"),
        ("-a:1", 29400, "The hostname of"),
        ("[::1", 29400, "The hostname of"),
        ("[::1]x", 29400, "The hostname of"),
        ("[host]:1", 29400, "The hostname of"),
        ("a:b:1", 29400, "The hostname of"),
    ],
)
def test_malformed_endpoints_are_refused_with_an_example(
    endpoint: str, default: int | None, message: str
) -> None:
    with pytest.raises(RendezvousParameterError, match=message) as info:
        parse_endpoint(endpoint, default)
    assert "e.g. '10.0.0.1:29400'" in str(info.value)


def test_host_and_port_checks() -> None:
    assert check_host("fe80::1%eth0") == "fe80::1%eth0"
    with pytest.raises(TypeError, match="must be a str, not NoneType"):
        check_host(None)
    with pytest.raises(ValueError, match="host name 'a b' must be"):
        check_host("a b")
    assert check_port(0) == 0
    with pytest.raises(ValueError, match="between 1 and 65535, got 0"):
        check_port(0, allow_zero=False)
    with pytest.raises(TypeError, match="must be an int, not bool"):
        check_port(True)
