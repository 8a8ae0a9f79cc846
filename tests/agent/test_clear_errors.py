"""When something is wrong, the console says so at once and ends with a message, not a traceback
(issue 27's table), through the real CLI: an endpoint where nothing listens, an etcd that is not
running, a run id the store has never seen, a port already taken. Each row checks when the first
line came, what the last lines say, that no traceback shows, and the exit code."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from _agents import wait_for
from _launcher import Launcher, free_port, launcher  # noqa: F401  (the fixture)

PRINT_RANK = str(Path(__file__).resolve().parents[2] / "examples" / "print_rank.py")
FIRST_LINE = 2.0
"""Seconds within which a wait that may last says what it waits for, counted from the command's
start: the interpreter's start and rdzv's import take 0.3 s on a quiet machine, over 1 s on a
loaded one; the waits said last 3 s and more."""


def timed(argv: list[str], timeout: float = 60) -> tuple[list[tuple[float, str]], int]:
    """Run ``rdzv ARGV``: its stderr lines, each with the seconds since the start, and its code."""
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "rdzv", *argv], stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True)
    assert process.stderr is not None
    lines = [(time.monotonic() - started, line.rstrip("\n")) for line in process.stderr]
    return lines, process.wait(timeout)


def no_traceback(lines: list[tuple[float, str]]) -> bool:
    return not any("Traceback" in text for _, text in lines)


def test_a_tcp_endpoint_where_nothing_listens() -> None:
    port = free_port()
    lines, code = timed(["run", "--nnodes", "2", "--rdzv-backend", "tcp", "--rdzv-endpoint",
                         f"127.0.0.1:{port}", "--rdzv-id", "job", "--rdzv-conf",
                         "is_host=0,read_timeout=3", PRINT_RANK])
    text = "\n".join(line for _, line in lines)
    assert code == 1 and no_traceback(lines), text
    first_at, first = lines[0]
    assert first_at < FIRST_LINE, lines[0]
    assert f"reaching the rendezvous store (tcp 127.0.0.1:{port})" in first
    assert "retrying for up to 3 s (--rdzv-conf read_timeout=SECONDS)" in first
    assert f"cannot reach the store server at 127.0.0.1:{port} yet: connection refused" in text
    assert (f"rdzv run: error: cannot reach the rendezvous (tcp 127.0.0.1:{port}) for run "
            "'job'") in text
    assert "likely: no store server listens there" in text and "to do: check --rdzv-endpoint" \
        in text and "(exit code 1; --log-level DEBUG shows the traceback)" in text


def test_the_traceback_with_log_level_debug() -> None:
    lines, code = timed(["run", "--log-level", "DEBUG", "--nnodes", "2", "--rdzv-endpoint",
                         f"127.0.0.1:{free_port()}", "--rdzv-conf", "is_host=0,read_timeout=1",
                         PRINT_RANK])
    assert code == 1 and not no_traceback(lines)


def test_an_etcd_that_is_not_running_is_said_every_10_s_not_every_second() -> None:
    port = free_port()
    lines, code = timed(["run", "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                         f"127.0.0.1:{port}", "--rdzv-id", "job", "--rdzv-conf",
                         "read_timeout=4", PRINT_RANK])
    text = "\n".join(line for _, line in lines)
    assert code == 1 and no_traceback(lines), text
    assert lines[0][0] < FIRST_LINE and "reaching the rendezvous store (etcd" in lines[0][1]
    retries = [line for _, line in lines if "no etcd endpoint answers yet" in line]
    assert 1 <= len(retries) <= 2, text  # once at first, then every 10 s: not one a second
    assert f"likely: etcd is not running at 127.0.0.1:{port}" in text, text


def test_a_run_the_store_has_never_seen_is_an_error_naming_the_runs_it_knows(
        launcher: Launcher) -> None:
    port = free_port()
    server = launcher.start([sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                             "--port", str(port)])
    wait_for(lambda: "listening on" in server.output(), 60, "the store server")
    lines, code = timed(["status", f"tcp://127.0.0.1:{port}/job"])
    assert code == 1 and no_traceback(lines), lines
    assert "this store has no run 'job' (it holds no run yet)" in lines[-1][1], lines
    waiting = launcher.start([sys.executable, "-m", "rdzv", "run", "--nnodes", "2",
                              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
                              "--rdzv-conf", "is_host=0", PRINT_RANK])
    wait_for(lambda: "waiting for nodes" in waiting.output(), 60, "a node of run 'job'")
    lines, code = timed(["status", f"tcp://127.0.0.1:{port}/jbo"])  # a typo
    assert code == 1 and no_traceback(lines), lines
    assert "rdzv status: error: this store has no run 'jbo' (the runs it knows: job); check " \
           "--rdzv-id" in lines[-1][1], lines
    assert timed(["status", f"tcp://127.0.0.1:{port}/job"])[1] == 0


def test_a_port_already_taken_is_named(launcher: Launcher) -> None:
    port = free_port()
    first = launcher.start([sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                            "--port", str(port)])
    wait_for(lambda: "listening on" in first.output(), 60, "the first store server")
    lines, code = timed(["serve", "--host", "127.0.0.1", "--port", str(port)])
    assert code == 1 and no_traceback(lines), lines
    last = lines[-1][1]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use: another process " \
           f"listens on port {port}" in last and "ss -ltnp" in last, lines
    lines, code = timed(["status", f"tcp://127.0.0.1:{port}/job", "--web", str(port)])
    assert code == 1 and no_traceback(lines), lines
    assert f"cannot serve the web view on 127.0.0.1:{port}: Address already in use: another " \
           f"process listens on port {port}" in lines[-1][1], lines
    # a node that must host the run's store (Slurm's first node: is_host=1) on a taken port
    lines, code = timed(["run", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job",
                         "--rdzv-conf", "is_host=1", PRINT_RANK])
    text = "\n".join(line for _, line in lines)
    assert code == 1 and no_traceback(lines), lines
    assert f"this node hosts the store (is_host) but port {port} is taken on it" in text, text
    assert "likely: another program (or another job's store) listens on that port" in text, text


def test_a_host_name_that_does_not_resolve_is_told_apart() -> None:
    """(Without a DNS query: the tests reach only loopback.) The tcp store's own words for a
    name that does not resolve lead to the advice for a name, not for a port."""
    from rdzv.agent import add_run_arguments, config_from_args
    from rdzv.agent._launch import unreachable
    from rdzv.cli._hints import HintingParser
    from rdzv.errors import StoreConnectionError

    parser = HintingParser(prog="rdzv run")
    add_run_arguments(parser)
    config = config_from_args(parser.parse_args([
        "--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400", PRINT_RANK]), env={})
    said = unreachable(config, StoreConnectionError(
        "could not connect to the store server at no-such-host.invalid:29400: cannot resolve "
        "the host name (Name or service not known; ...) (tried for 60 s)"))
    assert "likely: the host name in --rdzv-endpoint is misspelt" in said
    assert "to do: check --rdzv-endpoint's host" in said


def test_status_of_a_store_that_is_gone_answers_within_5_s() -> None:
    lines, code = timed(["status", f"tcp://127.0.0.1:{free_port()}/job"])
    text = "\n".join(line for _, line in lines)
    assert code == 1 and no_traceback(lines), text
    assert lines[-1][0] < 5.0 + 3.0, lines  # 5 s of tries (and the interpreter's start)
    assert lines[0][0] < FIRST_LINE and "rdzv status: reaching the store of run 'job'" in \
        lines[0][1] and "up to 5 s" in lines[0][1], lines
    assert "cannot open the store of run 'job'" in text and "(tried for 5 s)" in text, text
    assert "likely: the run has ended and its store went with the node that hosted it" in text


def test_the_last_call_is_named_when_it_begins(launcher: Launcher) -> None:
    port = free_port()
    server = launcher.start([sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                             "--port", str(port)])
    wait_for(lambda: "listening on" in server.output(), 60, "the store server")
    argv = [sys.executable, "-m", "rdzv", "run", "--nnodes", "1:3", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "job", "--rdzv-conf",
            "is_host=0,last_call_timeout=10", PRINT_RANK]
    nodes = [launcher.start(argv) for _ in range(2)]
    wait_for(lambda: all("waiting for nodes" in node.output() for node in nodes), 30,
             "both nodes joining")
    joined = time.monotonic()
    said = wait_for(lambda: next((line for line in nodes[0].output().splitlines()
                                  if "the last call waits" in line), None), 30,
                    "the last call, said")
    assert time.monotonic() - joined < 2 * FIRST_LINE + 1.0  # said as it begins (ticks: 1 s)
    assert "2 joined (min 1 reached); the last call waits" in said or \
        "1 joined (min 1 reached); the last call waits" in said, said
    assert "for up to 3 (--rdzv-conf last_call_timeout=SECONDS)" in said, said
    assert [node.wait(60) for node in nodes] == [0, 0]
    assert all("round formed in" in node.output() for node in nodes)
