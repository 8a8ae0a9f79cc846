"""The handler registry (built-ins by module path, entry points) and rendezvous URLs."""

from __future__ import annotations

import re
import textwrap

import pytest

from rdzv.rendezvous import (
    ENTRY_POINT_GROUP,
    RendezvousBackendError,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    get_rendezvous_handler,
    handler_registry,
    parse_rendezvous_url,
    rendezvous_url,
)
from rdzv.rendezvous._static import StaticRendezvousHandler
from test_api import _Handler  # the smallest concrete handler


def _creator(params: RendezvousParameters) -> _Handler:
    return _Handler(backend=params.backend)


def _other_creator(params: RendezvousParameters) -> _Handler:
    return _Handler(backend=params.backend)


def params(backend: str = "mine") -> RendezvousParameters:
    return RendezvousParameters(backend, "h:1", "job", 1, 1)


# -- registry --------------------------------------------------------------------------------

def test_register_and_create() -> None:
    registry = RendezvousHandlerRegistry()
    registry.register("mine", _creator)
    registry.register("mine", _creator)  # the same creator again: allowed, as torch
    handler = registry.create_handler(params())
    assert isinstance(handler, _Handler)
    assert registry.known_backends() == ["mine"]


def test_registering_a_taken_name_is_an_error() -> None:
    registry = RendezvousHandlerRegistry()
    registry.register("mine", _creator)
    with pytest.raises(ValueError, match=r"The rendezvous backend 'mine' cannot be registered with "
                       r"test_registry:_other_creator as it is already registered with "
                       r"test_registry:_creator\. Choose another backend name\."):
        registry.register("mine", _other_creator)


def test_registering_over_a_builtin_is_an_error() -> None:
    with pytest.raises(ValueError, match="already registered with rdzv.rendezvous._tcp:create_handler"):
        handler_registry.register("tcp", _creator)


def test_register_checks_its_arguments() -> None:
    registry = RendezvousHandlerRegistry()
    with pytest.raises(ValueError, match="backend name must be a non-empty string"):
        registry.register("", _creator)
    with pytest.raises(ValueError, match="must be callable as creator\\(params\\)"):
        registry.register("x", "not callable")  # type: ignore[arg-type]


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        handler_registry.create_handler(params("nosuch"))
    message = str(info.value)
    assert "The rendezvous backend 'nosuch' is not registered. Known backends: " in message
    for name in ("c10d", "etcd", "file", "memory", "static", "tcp"):
        assert name in message
    assert f"through the '{ENTRY_POINT_GROUP}' entry-point group" in message


def test_a_creator_returning_no_handler_is_an_error() -> None:
    registry = RendezvousHandlerRegistry()
    registry.register("bad", lambda p: object())  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="returned object, not a RendezvousHandler"):
        registry.create_handler(params("bad"))


def test_a_handler_of_another_backend_is_an_error() -> None:
    """As torch's registry: the handler's get_backend() must be the backend asked for."""
    registry = RendezvousHandlerRegistry()
    registry.register("asked", lambda p: _Handler(backend="other"))
    with pytest.raises(RendezvousBackendError, match="The rendezvous backend 'other' does not "
                       "match the requested backend 'asked'") as info:
        registry.create_handler(params("asked"))
    assert isinstance(info.value, RuntimeError)  # torch's class
    for name in ("tcp", "c10d"):  # one creator, two names: each handler says the name asked for
        handler = handler_registry.create_handler(
            RendezvousParameters(name, "127.0.0.1:0", "job", 1, 1, is_host=True)
        )
        try:
            assert handler.get_backend() == name
        finally:
            handler.shutdown()


def test_a_backend_whose_module_is_missing_says_so() -> None:
    registry = RendezvousHandlerRegistry({"ghost": "rdzv_no_such_module:create_handler"})
    with pytest.raises(ValueError, match="The rendezvous backend 'ghost' is not available: "
                       "rdzv_no_such_module:create_handler could not be loaded"):
        registry.create_handler(params("ghost"))


def test_builtin_backend_is_created_from_a_url() -> None:
    handler = get_rendezvous_handler("static://127.0.0.1:29400/job?rank=1&world_size=2")
    assert isinstance(handler, StaticRendezvousHandler)
    assert (handler.get_backend(), handler.get_run_id(), handler.rank) == ("static", "job", 1)


def test_memory_backend_is_created_from_a_url() -> None:
    handler = get_rendezvous_handler("memory://registry-test?nnodes=1&join_timeout=30")
    try:
        assert handler.get_backend() == "memory"
        info = handler.next_rendezvous()
        assert isinstance(info, RendezvousInfo) and (info.rank, info.world_size) == (0, 1)
    finally:
        handler.shutdown()


def test_entry_point_backend(tmp_path, monkeypatch) -> None:
    """A package installed with an entry point in the group is found without any import."""
    (tmp_path / "rdzv_test_plugin.py").write_text(textwrap.dedent("""
        from test_api import _Handler

        def create_handler(params):
            handler = _Handler(backend=params.backend)
            handler.waiting = int(params.get("waiting", 0))
            return handler
    """))
    dist_info = tmp_path / "rdzv_test_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: rdzv-test-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nplugged = rdzv_test_plugin:create_handler\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = RendezvousHandlerRegistry(entry_point_group=ENTRY_POINT_GROUP)
    assert "plugged" in registry.known_backends()
    handler = get_rendezvous_handler("plugged://h:1/job?nnodes=1&waiting=3", registry)
    assert handler.num_nodes_waiting() == 3
    assert "plugged" in handler_registry.known_backends()  # the default registry sees it too


# -- URLs ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "url, expected",
    [
        ("tcp://10.0.0.1:29400/job-42?min_nodes=2&max_nodes=4&last_call_timeout=1",
         ("tcp", "10.0.0.1:29400", "job-42", 2, 4, {"last_call_timeout": "1"})),
        ("c10d://host:29400/job?nnodes=2:4", ("c10d", "host:29400", "job", 2, 4, {})),
        ("tcp://host/job?nnodes=3", ("tcp", "host", "job", 3, 3, {})),
        ("tcp://[::1]:29400/job?nnodes=1:2", ("tcp", "[::1]:29400", "job", 1, 2, {})),
        ("file:///shared/dir/RUN_ID?nnodes=2:4", ("file", "/shared/dir", "RUN_ID", 2, 4, {})),
        ("file:///shared/my%20dir/job/?nnodes=1", ("file", "/shared/my dir", "job", 1, 1, {})),
        ("static://host:29400/job?rank=0&world_size=2",
         ("static", "host:29400", "job", 2, 2, {"rank": "0", "world_size": "2"})),
        ("memory://job?nnodes=2", ("memory", "", "job", 2, 2, {})),
        ("etcd://a:2379,b:2379/job?min_workers=1&max_workers=3",
         ("etcd", "a:2379,b:2379", "job", 1, 3, {})),
        ("TCP://host:1/job?nnodes=1&local_addr=10.1.1.1&is_host=true",
         ("tcp", "host:1", "job", 1, 1, {"is_host": "true"})),
        ("plugin://x:1/job%2Dx?nnodes=1&anything=1", ("plugin", "x:1", "job-x", 1, 1, {"anything": "1"})),
    ],
)
def test_url_parsing_and_round_trip(url: str, expected: tuple) -> None:
    parsed = parse_rendezvous_url(url)
    backend, endpoint, run_id, min_nodes, max_nodes, config = expected
    assert (parsed.backend, parsed.endpoint, parsed.run_id) == (backend, endpoint, run_id)
    assert (parsed.min_nodes, parsed.max_nodes, parsed.config) == (min_nodes, max_nodes, config)
    assert parse_rendezvous_url(rendezvous_url(parsed)) == parsed


def test_url_of_parameters_made_in_python() -> None:
    made = RendezvousParameters("tcp", "h:29400", "job", 2, 4, "10.0.0.2", join_timeout=5.5, is_host=False)
    url = rendezvous_url(made)
    assert url == ("tcp://h:29400/job?min_nodes=2&max_nodes=4&local_addr=10.0.0.2"
                   "&is_host=False&join_timeout=5.5")
    assert parse_rendezvous_url(url) == made
    assert parse_rendezvous_url(url).local_addr == "10.0.0.2"


def test_static_url_takes_world_size_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    parsed = parse_rendezvous_url("static://h:1/job?rank=2")
    assert (parsed.min_nodes, parsed.max_nodes) == (3, 3)


def test_file_url_of_a_relative_directory_is_refused() -> None:
    with pytest.raises(ValueError, match="A file URL needs an absolute directory, got 'rel/dir'"):
        rendezvous_url(RendezvousParameters("file", "rel/dir", "job", 1, 1))


@pytest.mark.parametrize(
    "url, problem",
    [
        ("10.0.0.1:29400", "a rendezvous URL has the form BACKEND://ENDPOINT/RUN_ID?OPTIONS"),
        ("://h:1/job?nnodes=1", "'' is not a backend name"),
        ("tcp://h:1?nnodes=1", "the run id is missing"),
        ("tcp://h:1/a/b?nnodes=1", "the run id 'a/b' must be one path segment"),
        ("tcp:///job?nnodes=1", "the HOST:PORT endpoint is missing"),
        ("tcp://h:port/job?nnodes=1", "'h:port' is not a HOST:PORT endpoint"),
        ("tcp://h:70000/job?nnodes=1", "'h:70000' is not a HOST:PORT endpoint"),
        ("tcp://::1:5/job?nnodes=1", "'::1:5' is not a HOST:PORT endpoint"),
        ("tcp://h:/job?nnodes=1", "'h:' is not a HOST:PORT endpoint"),
        ("tcp://~:1/job?nnodes=1", "'~:1' is not a HOST:PORT endpoint (The hostname of"),
        ("etcd://h:1,,h:2/job?nnodes=1", "'' is not a HOST:PORT endpoint"),
        ("file://shared/dir/job?nnodes=1", "a file URL has three slashes and an absolute "
         "directory (got host 'shared')"),
        ("file:///job?nnodes=1", "the directory before the run id is missing"),
        ("memory://a/b?nnodes=1", "this backend has no endpoint, only a run id"),
        ("tcp://h:1/job", "give the node counts as min_nodes and max_nodes, or nnodes=MIN:MAX"),
        ("tcp://h:1/job?min_nodes=2", "give the node counts as min_nodes and max_nodes"),
        ("tcp://h:1/job?nnodes=two", "node counts must be integers"),
        ("tcp://h:1/job?nnodes=2&min_nodes=1", "give either nnodes or min_nodes/max_nodes, not both"),
        ("tcp://h:1/job?nnodes=1&nnodes=2", "option 'nnodes' is given twice"),
        ("tcp://h:1/job?nnodes=1#frag", "unexpected fragment '#frag'"),
        ("tcp://h:1/job?nnodes", "cannot be parsed"),
        ("static://h:1/job?rank=0&world_size=2&nnodes=3", "a static rendezvous has min_nodes = "
         "max_nodes = world_size"),
        ("etcd://h:1/job?min_workers=1&min_nodes=1&max_nodes=1", "give only one of 'min_workers' "
         "and 'min_nodes'"),
    ],
)
def test_malformed_urls_say_what_is_wrong_and_show_an_example(url: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_rendezvous_url(url)
    message = str(info.value)
    assert problem in message
    assert re.search(r"Example: \w+://", message), message


def test_url_options_are_checked_like_parameters() -> None:
    with pytest.raises(ValueError, match="Did you mean 'join_timeout'"):
        parse_rendezvous_url("tcp://h:1/job?nnodes=1&join_timeoutt=3")
    with pytest.raises(ValueError, match="'min_workers' is torch's older name of 'min_nodes'"):
        parse_rendezvous_url("tcp://h:1/job?min_workers=1&max_nodes=1")
