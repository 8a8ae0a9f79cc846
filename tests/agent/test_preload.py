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
    import sys
    preloaded = "preload_probe" in sys.modules  # before this program imports anything
    import atexit, json, os, pickle, time
    import preload_probe
    rank = os.environ["RANK"]
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]

    def typed(x: int) -> None:  # its annotations are objects (no __future__ of the template's)
        pass

    seen = {"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
            "cwd": os.getcwd(), "rank": rank, "attempt": attempt, "pid": os.getpid(),
            "ppid": os.getppid(), "session": os.getsid(0), "preloaded": preloaded,
            "imported_by": preload_probe.PID, "local_world": os.environ["LOCAL_WORLD_SIZE"],
            "stdin": sys.stdin.read(), "annotation": repr(typed.__annotations__["x"]), "comm": open("/proc/self/comm").read().strip(),
            "cmdline": open("/proc/self/cmdline").read().split("\\0")}
    out = sys.argv[1]
    with open(os.path.join(out, f"{rank}-{attempt}-{os.getpid()}.json"), "w") as handle:
        json.dump(seen, handle)

    class Box:
        pass

    def at_exit():  # after the program's body: __main__ is still the program's
        with open(os.path.join(out, f"atexit-{rank}-{attempt}"), "wb") as handle:
            handle.write(pickle.dumps(Box()))

    atexit.register(at_exit)
    print(f"rank {rank} says hello")
    print(f"rank {rank} on stderr", file=sys.stderr)
    mode = sys.argv[2]
    if mode == "die-once" and rank == "1" and attempt == "0":
        os.kill(os.getpid(), 9)
    if mode == "raise" and rank == "1":
        raise ValueError("rank 1 fails on purpose")
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
    found = re.search(r"worker template \(pid (\d+)\) imports preload_probe", text)
    assert found, text
    return int(found.group(1))


@pytest.fixture
def job(tmp_path: Path) -> Any:
    """A program in its own directory (not the agent's working directory, ``tmp_path``), next to
    the module it preloads."""

    class Job:
        directory = tmp_path / "program"
        script = directory / "program.py"
        out = tmp_path / "out"
        stop = str(tmp_path / "stop")
        cwd = str(tmp_path)

        def args(self, mode: str, *extra: str, module: bool = False) -> list[str]:
            program = ["-m", "program"] if module else [str(self.script)]
            return ["--standalone", "--nproc-per-node", "2", "--preload", "preload_probe",
                    "--log-dir", str(tmp_path / "logs"), *extra, *program,
                    str(self.out), mode, self.stop]

    job = Job()
    job.directory.mkdir()
    job.script.write_text(PROGRAM)
    (job.directory / "preload_probe.py").write_text("import os\nPID = os.getpid()\n")
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
        assert worker["path0"] == str(job.directory)  # the script's directory...
        assert worker["cwd"] == job.cwd  # ...and the agent's working directory
        assert worker["preloaded"] and worker["imported_by"] == template  # imported once, there
        assert worker["ppid"] == template  # forked by the template...
        assert worker["session"] == worker["pid"]  # ...in a session of its own
        assert worker["local_world"] == "2" and worker["stdin"] == ""
        assert worker["annotation"] == "<class 'int'>"
        assert str(job.script) in worker["cmdline"]  # `pgrep -f program.py` finds it...
        assert worker["comm"] != "rdzv-template"  # ...and `ps -o comm` tells it from the template
        assert (job.out / f"atexit-{worker['rank']}-0").stat().st_size > 0
    assert "[0]:rank 0 says hello" in text and "[1]:rank 1 on stderr" in text
    assert "the workers are forked from it" in text
    # the node joins once its template is ready: in a round, its workers start at once
    assert text.index("worker template ready in") < text.index("waiting for nodes"), text
    wait_for(lambda: not pid_alive(template), 30.0, "the template to end with its agent")


def test_a_module_runs_as_python_m_runs_it(agents: Any, job: Any) -> None:
    node = agents.start(job.args("succeed", module=True), env={"PYTHONPATH": os.pathsep.join(
        [str(job.directory), os.environ.get("PYTHONPATH", "")])})
    assert node.wait() == 0, node.output()
    template = template_pid(node.output())
    for worker in reports(job.out):
        assert worker["name"] == "__main__" and worker["file"] == str(job.script)
        assert worker["argv"] == [str(job.script), str(job.out), "succeed", job.stop]
        assert worker["path0"] == job.cwd  # python -m: the working directory
        assert worker["imported_by"] == worker["ppid"] == template


@pytest.mark.parametrize(("mode", "code", "shown"), [
    ("fail", 3, "[1]:rank 1 says hello"),
    ("raise", 1, "[1]:ValueError: rank 1 fails on purpose"),
])
def test_a_failing_forked_worker_is_reported_with_its_exit_code(
    agents: Any, job: Any, mode: str, code: int, shown: str
) -> None:
    node = agents.start(job.args(mode))
    assert node.wait() == 1, node.output()
    text = node.output()
    assert "root cause: global rank 1 (local rank 1" in text, text
    assert f"exit code {code}" in text, text
    assert shown in text, text
    assert "_template_server" not in text  # a traceback shows the program's frames, as python's


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
    assert Path(f"/proc/{template}/comm").read_text().strip() == "rdzv-template"
    os.kill(template, signal.SIGKILL)
    wait_for(lambda: len(reports(job.out)) == 4, JOIN, "the workers to restart")
    text = node.output()
    assert "ended with signal SIGKILL" in text, text
    assert "--preload: the worker template is not usable (it ended (exit code -9)); starting " \
        "workers as new processes" in text, text
    restarted = [s for s in reports(job.out) if s["attempt"] == "1"]
    assert all(s["ppid"] == node.pid and not s["preloaded"] for s in restarted)
    assert not any(pid_alive(s["pid"]) for s in reports(job.out) if s["attempt"] == "0")
    Path(job.stop).touch()
    assert node.wait() == 0, node.output()


def test_a_template_that_cannot_import_says_so_and_the_workers_start_anyway(
    agents: Any, job: Any
) -> None:
    (job.directory / "broken_at_import.py").write_text("raise RuntimeError('no driver here')\n")
    args = job.args("succeed")
    args[args.index("preload_probe")] = "preload_probe,broken_at_import"
    node = agents.start(args)
    assert node.wait() == 0, node.output()
    text = node.output()
    assert "--preload: the worker template is not usable (cannot import 'broken_at_import': " \
        "RuntimeError: no driver here); starting workers as new processes" in text, text
    assert [s["preloaded"] for s in reports(job.out)] == [False, False]


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
