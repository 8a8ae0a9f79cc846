"""The worker group with real processes: env, log files, console prefix, stopping, error files."""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from typing import Any

import pytest

from _agents import pid_alive, wait_for
from rdzv.agent._errors import failure_summary, read_error_file, WorkerFailure
from rdzv.agent._workers import WorkerExited, WorkerGroup, WorkerSpec

EVENT_TIMEOUT = 120.0


def script(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def make_group(tmp_path: Any, command: list[str], shown: frozenset[str] = frozenset()) -> Any:
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    group = WorkerGroup(command, str(tmp_path / "attempt_0"), events, 7, lambda rank: shown)
    return group, events


def specs(count: int, extra: dict[str, str] | None = None) -> list[WorkerSpec]:
    return [WorkerSpec(i, 10 + i, {**os.environ, "RANK": str(10 + i), **(extra or {})})
            for i in range(count)]


def exits(events: Any, count: int) -> list[WorkerExited]:
    return [events.get(timeout=EVENT_TIMEOUT) for _ in range(count)]


def test_workers_get_their_env_and_log_files(tmp_path: Any) -> None:
    code = ("import os, sys; print('out', os.environ['RANK']); "
            "print('err', os.environ['TORCHELASTIC_ERROR_FILE'], file=sys.stderr)")
    group, events = make_group(tmp_path, script(code))
    group.start(specs(2))
    done = exits(events, 2)
    assert sorted(e.local_rank for e in done) == [0, 1]
    assert all(e.returncode == 0 and e.generation == 7 for e in done)
    group.stop(timeout=1)
    for local in (0, 1):
        (stdout, stderr), error_file = group.worker_files(local)
        assert open(stdout).read() == f"out {10 + local}\n"
        assert open(stderr).read() == f"err {error_file}\n"
        assert error_file == str(tmp_path / "attempt_0" / str(local) / "error.json")


def test_teed_lines_reach_the_console_with_the_rank_prefix(tmp_path: Any,
                                                            capfd: Any) -> None:
    group, events = make_group(tmp_path, script("print('a'); print('b', end='')"),
                               frozenset({"stdout"}))
    group.start(specs(1))
    exits(events, 1)
    group.stop(timeout=1)
    assert capfd.readouterr().out == "[10]:a\n[10]:b\n"
    (stdout, _), _ = group.worker_files(0)
    assert open(stdout).read() == "a\nb"


def test_stop_sends_sigterm_then_sigkill_to_whole_process_groups(tmp_path: Any) -> None:
    pid_file = tmp_path / "grandchild"
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    group, events = make_group(tmp_path, script(code))
    group.start(specs(1))
    grandchild = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), EVENT_TIMEOUT,
                              "the worker's child"))
    group.stop(signal.SIGTERM, timeout=0.5)
    assert group.returncodes()[0] == -signal.SIGKILL  # it ignored SIGTERM
    wait_for(lambda: not pid_alive(grandchild), EVENT_TIMEOUT, "the grandchild to die")


def test_a_worker_that_honours_sigterm_ends_within_the_grace(tmp_path: Any) -> None:
    group, events = make_group(tmp_path, script("import time; print('up', flush=True); "
                                                "time.sleep(120)"))
    group.start(specs(2))
    group.stop(signal.SIGTERM, timeout=20)
    assert group.returncodes() == {0: -signal.SIGTERM, 1: -signal.SIGTERM}
    assert group.all_exited()


def test_record_writes_the_error_file_and_the_summary_shows_it(tmp_path: Any) -> None:
    code = ("from rdzv.agent import record\n"
            "@record\n"
            "def main():\n"
            "    raise KeyError('missing shard')\n"
            "main()\n")
    group, events = make_group(tmp_path, script(code))
    group.start(specs(1))
    (event,) = exits(events, 1)
    group.stop(timeout=1)
    assert event.returncode == 1
    logs, error_file = group.worker_files(0)
    error = read_error_file(error_file)
    assert error is not None and error.message == "KeyError: 'missing shard'"
    assert 'line 4, in main' in error.traceback
    failure = WorkerFailure(10, 0, "trainer", "node-a", 123, event.returncode, event.time,
                            logs, error)
    killed = WorkerFailure(11, 1, "trainer", "node-b", 124, -signal.SIGKILL, event.time + 1,
                           (), None)
    text = failure_summary([killed, failure], "workers failed after 0 restart(s)")
    assert "root cause: global rank 10 (local rank 0, role trainer) on host node-a" in text
    assert "KeyError: 'missing shard'" in text and logs[0] in text
    assert "global rank 11 on node-b: signal SIGKILL (9)" in text


def test_summary_without_error_file_says_how_to_get_one() -> None:
    failure = WorkerFailure(3, 1, "default", "h", 9, -signal.SIGSEGV, time.time(), ("x.log",),
                            None)
    text = failure_summary([failure], "gave up")
    assert "signal SIGSEGV (11)" in text and "rdzv.agent.record" in text


def test_record_keeps_sys_exit_unrecorded(tmp_path: Any, monkeypatch: Any) -> None:
    from rdzv.agent import record

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def leave() -> None:
        sys.exit(3)

    with pytest.raises(SystemExit):
        leave()
    assert not path.exists()
