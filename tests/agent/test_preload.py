"""``rdzv run --preload``: workers forked from a worker template that imported their modules once.

Real agents and workers: each worker reports what a Python program sees of itself (its name,
file, argv, path, directory, environment, session, parent), so the tests assert that a forked
worker runs as ``python -u SCRIPT`` would, and that exits, restarts, a template that dies and a
template that cannot import are handled as the person at the console expects.
"""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
from pathlib import Path
from typing import Any

import pytest

from _agents import JOIN, pid_alive, rdzv_cli, wait_for
from rdzv.agent._template import python_program

pytestmark = pytest.mark.timeout(300)

PROGRAM = textwrap.dedent('''
    import json, os, sys, time
    rank = os.environ["RANK"]
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    seen = {"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
            "cwd": os.getcwd(), "rank": rank, "attempt": attempt, "pid": os.getpid(),
            "ppid": os.getppid(), "session": os.getsid(0), "json": "json" in sys.modules,
            "local_world": os.environ["LOCAL_WORLD_SIZE"], "stdin": sys.stdin.read()}
    out = os.path.join(sys.argv[1], f"{rank}-{attempt}-{os.getpid()}.json")
    with open(out, "w") as handle:
        json.dump(seen, handle)
    print(f"rank {rank} says hello")
    print(f"rank {rank} on stderr", file=sys.stderr)
    mode = sys.argv[2]
    if mode == "die-once" and rank == "1" and attempt == "0":
        os.kill(os.getpid(), 9)
    if mode == "until":
        for _ in range(1200):
            if os.path.exists(sys.argv[3]):
                break
            time.sleep(0.05)
    sys.exit(3 if mode == "fail" and rank == "1" else 0)
''')


def reports(out: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("*.json"))]


def template_pid(text: str) -> int:
    found = re.search(r"worker template \(pid (\d+)\) imports json", text)
    assert found, text
    return int(found.group(1))


@pytest.fixture
def job(tmp_path: Path) -> Any:
    class Job:
        script = tmp_path / "program.py"
        out = tmp_path / "out"
        stop = str(tmp_path / "stop")

        def args(self, mode: str, *extra: str) -> list[str]:
            return ["--standalone", "--nproc-per-node", "2", "--preload", "json",
                    "--log-dir", str(tmp_path / "logs"), *extra, str(self.script),
                    str(self.out), mode, self.stop]

    job = Job()
    job.script.write_text(PROGRAM)
    job.out.mkdir()
    return job


def test_forked_workers_run_as_python_runs_a_script(agents: Any, job: Any) -> None:
    node = agents.start(job.args("succeed"))
    assert node.wait() == 0, node.output()
    text = node.output()
    template = template_pid(text)
    seen = reports(job.out)
    assert sorted(s["rank"] for s in seen) == ["0", "1"]
    for worker in seen:
        assert worker["name"] == "__main__" and worker["file"] == str(job.script)
        assert worker["argv"] == [str(job.script), str(job.out), "succeed", job.stop]
        assert worker["path0"] == str(job.script.parent)
        assert worker["cwd"] == str(job.script.parent)  # the agent's (the test's directory)
        assert worker["json"] is True  # preloaded: already imported when the program starts
        assert worker["ppid"] == template  # forked by the template...
        assert worker["session"] == worker["pid"]  # ...in a session of its own
        assert worker["local_world"] == "2" and worker["stdin"] == ""
    assert "[0]:rank 0 says hello" in text and "[1]:rank 1 on stderr" in text
    assert "the workers are forked from it" in text
    wait_for(lambda: not pid_alive(template), 30.0, "the template to end with its agent")


def test_a_failing_forked_worker_is_reported_with_its_exit_code(agents: Any, job: Any) -> None:
    node = agents.start(job.args("fail"))
    assert node.wait() == 1, node.output()
    text = node.output()
    assert "root cause: global rank 1 (local rank 1" in text, text
    assert "exit code 3" in text, text


def test_a_killed_forked_worker_restarts_from_the_template(agents: Any, job: Any) -> None:
    node = agents.start(job.args("die-once", "--max-restarts", "1"))
    assert node.wait() == 0, node.output()
    text = node.output()
    assert "local rank 1 ended with signal SIGKILL" in text, text
    assert "restart 1 of 1" in text, text
    template = template_pid(text)
    seen = reports(job.out)
    assert sorted((s["rank"], s["attempt"]) for s in seen) == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {s["ppid"] for s in seen} == {template}  # the restart forked from the same template


def test_workers_die_with_their_template_and_restart_as_new_processes(
    agents: Any, job: Any
) -> None:
    node = agents.start(job.args("until", "--max-restarts", "1"))
    wait_for(lambda: len(reports(job.out)) == 2, JOIN, "two forked workers")
    template = template_pid(node.output())
    os.kill(template, signal.SIGKILL)
    wait_for(lambda: len(reports(job.out)) == 4, JOIN, "the workers to restart")
    text = node.output()
    assert "ended with signal SIGKILL" in text, text
    assert "--preload: the worker template is not usable (it ended (exit code -9)); starting " \
        "workers as new processes" in text, text
    restarted = [s for s in reports(job.out) if s["attempt"] == "1"]
    assert all(s["ppid"] == node.pid for s in restarted)  # new processes of the agent
    assert not any(pid_alive(s["pid"]) for s in reports(job.out) if s["attempt"] == "0")
    Path(job.stop).touch()
    assert node.wait() == 0, node.output()


def test_a_template_that_cannot_import_says_so_and_the_workers_start_anyway(
    agents: Any, job: Any, tmp_path: Path
) -> None:
    (tmp_path / "broken_at_import.py").write_text("raise RuntimeError('no GPU driver here')\n")
    args = job.args("succeed")
    args[args.index("json")] = "json,broken_at_import"
    node = agents.start(args, env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    assert node.wait() == 0, node.output()
    text = node.output()
    assert "--preload: the worker template is not usable (cannot import 'broken_at_import': " \
        "RuntimeError: no GPU driver here); starting workers as new processes" in text, text
    assert len(reports(job.out)) == 2


@pytest.mark.parametrize(("flags", "message"), [
    (["--preload", "no_such_module_anywhere"],
     "--preload: no module named 'no_such_module_anywhere' in "),
    (["--preload", "torch nn"], "--preload: 'torch nn' is not a Python module name"),
    (["--preload", "json", "--no-python"], "--preload: forks Python workers from a template; "
                                           "it cannot start an executable"),
])
def test_bad_preload_flags_are_refused_at_once(flags: list[str], message: str) -> None:
    result = rdzv_cli("run", "--standalone", *flags, "true" if "--no-python" in flags else
                      __file__)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(("command", "program"), [
    (["py", "-u", "train.py", "--lr", "1"], (["path", "train.py"], ["train.py", "--lr", "1"], True)),
    (["py", "train.py"], (["path", "train.py"], ["train.py"], False)),
    (["py", "-u", "-m", "pkg.train", "-x"], (["module", "pkg.train"], ["pkg.train", "-x"], True)),
    (["py", "-u", "-c", "print(1)"], None),  # not a script or module: started as a new process
    (["py", "-u", "-m"], None),
])
def test_which_commands_a_template_runs(command: list[str], program: Any) -> None:
    assert python_program(command) == program
