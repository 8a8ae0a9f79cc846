"""RendezvousParameters: torch's accessors, and the checks derived from each backend's option table."""

from __future__ import annotations

import pathlib
import re

import pytest

from rdzv.rendezvous import RendezvousParameters
from rdzv.rendezvous._params import BACKENDS, options_markdown

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "rendezvous.md"


def tcp(**options: object) -> RendezvousParameters:
    return RendezvousParameters("tcp", "127.0.0.1:29400", "job", 1, 2, **options)


@pytest.mark.parametrize(
    "args, message",
    [
        (("", "h:1", "job", 1, 1), "The rendezvous backend name must be a non-empty string"),
        (("tcp", "h:1", "", 1, 1), "The rendezvous run_id must be a non-empty string"),
        (("tcp", "h:1", "a/b", 1, 1), "run_id 'a/b' must not contain '/' or whitespace"),
        (("tcp", "h:1", "job", 0, 1), "(min_nodes=0) must be greater than zero"),
        (("tcp", "h:1", "job", 3, 2), "(max_nodes=2) must be greater than or equal to the minimum"),
        (("tcp", "h:1", "job", "two", 2), "min_nodes must be an integer, got 'two'"),
        (("tcp", "h:1", "job", 1, True), "max_nodes must be an integer, got True"),
        (("tcp", 29400, "job", 1, 1), "endpoint must be a string such as 'host:29400', not int"),
        (("tcp", "h:1", "job", 1, 1, "10.0.0.5/24"),
         "local_addr '10.0.0.5/24' must be this node's host name or IP address"),
        (("tcp", "h:1", "job", 1, 1, ""), "local_addr '' must be"),
    ],
)
def test_invalid_parameters_are_named(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RendezvousParameters(*args)


def test_unknown_option_names_the_valid_ones_and_suggests_a_near_miss() -> None:
    with pytest.raises(ValueError) as info:
        tcp(last_cal_timeout=1)
    message = str(info.value)
    assert "Unknown option 'last_cal_timeout' for the 'tcp' rendezvous backend." in message
    assert "Did you mean 'last_call_timeout'?" in message
    assert "Valid options: join_timeout, last_call_timeout, close_timeout" in message


def test_unknown_option_without_near_miss_lists_valid_options_only() -> None:
    with pytest.raises(ValueError) as info:
        RendezvousParameters("memory", "", "job", 1, 1, zzz=1)
    assert "Did you mean" not in str(info.value)
    assert "Valid options: join_timeout" in str(info.value)


def test_torch_legacy_parameter_name_is_explained() -> None:
    with pytest.raises(ValueError, match="'min_workers' is torch's older name of 'min_nodes'"):
        tcp(min_workers=2)


@pytest.mark.parametrize(
    "backend, options, message",
    [
        ("tcp", {"join_timeout": "soon"}, "The option 'join_timeout' of the 'tcp' rendezvous "
         "backend must be a number of seconds >= 0, got 'soon'."),
        ("tcp", {"last_call_timeout": -1}, "'last_call_timeout' of the 'tcp' rendezvous backend "
         "must be a number of seconds >= 0, got -1."),
        ("file", {"heartbeat_misses": 0}, "'heartbeat_misses' of the 'file' rendezvous backend "
         "must be an integer >= 1, got 0."),
        ("tcp", {"heartbeat_misses": 2.5}, "must be an integer >= 1, got 2.5."),
        ("tcp", {"is_host": "maybe"}, "'is_host' of the 'tcp' rendezvous backend must be a "
         "boolean (1/true/yes/on or 0/false/no/off), got 'maybe'."),
        ("tcp", {"join_timeout": True}, "must be a number of seconds >= 0, got True."),
        ("tcp", {"join_timeout": "nan"}, "must be a number of seconds >= 0, got 'nan'."),
        ("etcd", {"protocol": "ftp"}, "'protocol' of the 'etcd' rendezvous backend must be one "
         "of http, https; got 'ftp'."),
        ("static", {"rank": -1}, "'rank' of the 'static' rendezvous backend must be an integer "
         ">= 0, got -1."),
        ("tcp", {"secret_file": 3}, "'secret_file' of the 'tcp' rendezvous backend must be a "
         "string, got 3."),
    ],
)
def test_values_of_the_wrong_type_are_named(backend: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RendezvousParameters(backend, "127.0.0.1:29400", "job", 1, 1, **options)


def test_defaults_are_torchs() -> None:
    params = tcp()
    assert params.get_option("join_timeout") == 600.0
    assert params.get_option("last_call_timeout") == 30.0
    assert params.get_option("close_timeout") == 30.0
    assert params.get_option("heartbeat_interval") == 5.0
    assert params.get_option("heartbeat_misses") == 3
    assert params.get_option("is_host") is None


def test_get_option_converts_strings_from_urls_and_clis() -> None:
    params = tcp(join_timeout="12.5", heartbeat_misses="4", is_host="on")
    assert params.get_option("join_timeout") == 12.5
    assert params.get_option("heartbeat_misses") == 4
    assert params.get_option("is_host") is True
    assert params.get("join_timeout") == "12.5"  # torch's get: the value as given


def test_get_option_of_an_undeclared_option_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="declares no option 'nope'"):
        tcp().get_option("nope")


def test_torch_option_names_are_renamed() -> None:
    params = tcp(keep_alive_interval=2, keep_alive_max_attempt="5")
    assert params.config == {"heartbeat_interval": 2, "heartbeat_misses": "5"}
    assert params.get_option("heartbeat_interval") == 2.0
    etcd = RendezvousParameters("etcd", "h:2379", "job", 1, 1, cacert="/ca.pem", cert="/c", key="/k")
    assert etcd.get_option("ca_cert") == "/ca.pem"
    assert etcd.get_option("ssl_cert_key") == "/k"


def test_an_option_given_under_both_names_is_rejected() -> None:
    with pytest.raises(ValueError, match="'heartbeat_interval' of the 'tcp' rendezvous backend was given twice"):
        tcp(heartbeat_interval=1, keep_alive_interval=2)


def test_torchrun_configs_are_accepted() -> None:
    # torchrun always passes `timeout`; for static it also passes `rank`.
    assert RendezvousParameters("c10d", "h:29400", "job", 1, 4, timeout=900).get("timeout") == 900
    static = RendezvousParameters("static", "h:29400", "job", 2, 2, timeout=900, rank=1)
    assert static.get_option("rank") == 1


def test_third_party_backend_options_pass_unchecked() -> None:
    params = RendezvousParameters("my-backend", "x", "job", 1, 1, anything="goes")
    assert params.get("anything") == "goes"


@pytest.mark.parametrize("value", ["1", "true", "T", "yes", "Y", "on", 1, True])
def test_get_as_bool_true(value: object) -> None:
    assert tcp(is_host=value).get_as_bool("is_host") is True


@pytest.mark.parametrize("value", ["0", "false", "F", "no", "n", "OFF", 0, False])
def test_get_as_bool_false(value: object) -> None:
    assert tcp(is_host=value).get_as_bool("is_host") is False


def test_get_as_bool_default_and_error() -> None:
    params = RendezvousParameters("x", "", "job", 1, 1, flag="perhaps", n=2)
    assert params.get_as_bool("missing") is None
    assert params.get_as_bool("missing", True) is True
    with pytest.raises(ValueError, match="'flag' does not represent a valid boolean value: got 'perhaps'"):
        params.get_as_bool("flag")
    with pytest.raises(ValueError, match="'n' does not represent a valid boolean"):
        params.get_as_bool("n")


def test_get_as_int() -> None:
    params = RendezvousParameters("x", "", "job", 1, 1, n="7", bad="seven")
    assert params.get_as_int("n") == 7
    assert params.get_as_int("missing") is None
    assert params.get_as_int("missing", 3) == 3
    assert params.get("missing", "d") == "d"
    with pytest.raises(ValueError, match="'bad' does not represent a valid integer value: got 'seven'"):
        params.get_as_int("bad")


def test_parameters_compare_by_value() -> None:
    assert tcp(join_timeout=5) == tcp(join_timeout="5")
    assert tcp() != tcp(join_timeout=5)
    assert "join_timeout=5" in repr(tcp(join_timeout=5))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_docs_show_each_backends_option_table(backend: str) -> None:
    """docs/rendezvous.md carries the table generated from the code (regenerate if this fails)."""
    assert options_markdown(backend) in DOCS.read_text()
