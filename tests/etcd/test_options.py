"""Parsing etcd endpoints and options: what users type, and the errors for what is wrong."""

from __future__ import annotations

import pytest

from rdzv.etcd import EtcdOptions, parse_endpoints
from rdzv.etcd._client import prefix_range_end


def test_endpoint_forms() -> None:
    assert parse_endpoints("127.0.0.1:2379") == ("http", ("127.0.0.1:2379",))
    assert parse_endpoints("a, b:1,http://c:2/") == ("http", ("a:2379", "b:1", "c:2"))
    assert parse_endpoints(["https://h1", "h2:23"]) == ("https", ("h1:2379", "h2:23"))
    assert parse_endpoints("[::1]:2379,[::1]") == ("http", ("[::1]:2379", "[::1]:2379"))
    assert parse_endpoints("h", protocol="https") == ("https", ("h:2379",))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "no etcd endpoint"),
        ("ftp://h:1", "scheme must be http or https"),
        ("h:notaport", "The port number of the rendezvous endpoint 'h:notaport' must be"),
        ("h:70000", "The port number of"),
        ("h:", "The port number of the rendezvous endpoint 'h:'"),
        ("h:0", "port 0 is not a number in 1..65535"),
        ("~:2379", "The hostname of the rendezvous endpoint '~:2379' must be"),
        ("http://h:1,https://h:2", "mix http and https"),
        ("http://h:1/v3", "has a path"),
        (":2379", "The hostname of"),
        ("h:1,,h:2", "no host"),
    ],
)
def test_bad_endpoints_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_endpoints(spec)


def test_options_from_config_accept_torch_names(tmp_path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("not used")
    options = EtcdOptions.from_config(
        "h1,h2",
        {
            "protocol": "https",
            "cacert": str(pem),
            "cert": str(pem),
            "key": str(pem),
            "user": "u",
            "password": "s3cr3t",
            "request_timeout": "3",
            "other": 1,
        },  # fmt: skip
    )
    assert options.endpoints == ("h1:2379", "h2:2379")
    assert (options.ca_cert, options.ssl_cert, options.ssl_cert_key) == (str(pem),) * 3
    assert options.request_timeout == 3.0
    assert "s3cr3t" not in repr(options)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"protocol": "tcp"}, "protocol must be"),
        ({"ca_cert": "/no/such.pem", "protocol": "https"}, "no such file"),
        ({"user": "u"}, "user and password"),
        ({"request_timeout": "soon"}, "not a number of seconds"),
        ({"retry_timeout": 0}, "must be > 0"),
    ],
)
def test_bad_options_say_what_is_wrong(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EtcdOptions.from_config("h", config)


def test_tls_files_need_https(tmp_path) -> None:
    pem = tmp_path / "ca.pem"
    pem.write_text("x")
    with pytest.raises(ValueError, match="protocol=https"):
        EtcdOptions.from_config("h", {"ca_cert": str(pem)})


def test_strict_options_reject_typos() -> None:
    with pytest.raises(TypeError, match="unknown etcd option.*pasword"):
        EtcdOptions.from_config("h", {"pasword": "x"}, strict=True)


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"job/") == b"job0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"") == b"\0"
