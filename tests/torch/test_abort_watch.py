"""An abort that does not wake the training thread (gloo can leave a collective waiting on a
closed peer until the group's timeout): the worker ends itself within the grace, so its agent
restarts it alone; a worker waiting for a plan is left alone."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from typing import Any, Callable

from rdzv._channel import ENV_CHANNEL, ChannelServer
from rdzv._messages import Abort, Hello, Stop
from rdzv.torch._group import ABORT_GRACE

WORKER = r"""
import socket, sys, threading, time
from rdzv.torch._group import agent_link, group_sockets
link = agent_link()
listener = socket.create_server(("127.0.0.1", 0))
with group_sockets.recording():  # a group's connection, as init_process_group opens it
    peer = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
print("ready", flush=True)
if sys.argv[1] == "stuck":
    time.sleep(60)  # a collective that the shut-down sockets do not wake
else:
    watch = link._watch_abort

    def watch_and_say(moves):  # an abort's watch of the training thread; "watched" once it ended
        watch(moves)
        watchers = [t for t in threading.enumerate() if t.name == "rdzv-abort-watch"]
        threading.Thread(target=lambda: ([t.join() for t in watchers], print("watched", flush=True)),
                         daemon=True).start()

    def say_waiting():  # "waiting" once the training thread waits for its plan
        with link._cond:
            while not link._waiting:
                link._cond.wait(0.01)
        print("waiting", flush=True)

    link._watch_abort = watch_and_say
    threading.Thread(target=say_waiting, daemon=True).start()
    link.wait()  # out of every collective, waiting for its next plan
"""


CREATING = r"""
import socket, threading
from rdzv.torch._group import agent_link, group_sockets
link = agent_link()
listener = socket.create_server(("127.0.0.1", 0))
with group_sockets.recording():  # a group being created, as init_process_group does it
    first = socket.create_connection(listener.getsockname())
    first_end, _ = listener.accept()
    print("ready", flush=True)
    first.recv(1)  # the abort shuts it down
    # torch's store client connects again and waits there for peers that went on without it
    again = socket.create_connection(listener.getsockname())
    again_end, _ = listener.accept()
    again.recv(1)
print("creation failed", flush=True)  # torch raises; the worker waits for its next plan
watch = [t for t in threading.enumerate() if t.name == "rdzv-abort-watch"]
link_wait = threading.Thread(target=link.wait, daemon=True)
link_wait.start()
for thread in watch:
    thread.join()
print("watched", flush=True)
link_wait.join()
"""


TOLD_TO_LEAVE = r"""
import signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as in a collective: no handler runs
from rdzv.torch._group import agent_link
link = agent_link()
print("ready", flush=True)
with link._cond:  # the agent's end is seen first
    link._cond.wait_for(lambda: link._gone, timeout=30)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # the collective fails: it runs now
link.wait()  # the step failed: the worker waits for its next plan
"""


STOPPED = r"""
from rdzv.torch._group import agent_link
link = agent_link()
print("ready", flush=True)
link.wait()  # a step failed: the worker waits for its next plan
"""


def start(mode: str, server: ChannelServer, script: str = WORKER) -> subprocess.Popen[str]:
    env = {**os.environ, ENV_CHANNEL: server.path, "LOCAL_RANK": "0"}
    worker = subprocess.Popen([sys.executable, "-c", script, mode], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert worker.stdout is not None and worker.stdout.readline() == "ready\n"
    return worker


def test_a_worker_whose_collective_outlives_the_abort_ends_itself() -> None:
    seen: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    server = ChannelServer(lambda rank, message: seen.put((rank, message)))
    worker = start("stuck", server)
    try:
        assert isinstance(seen.get(timeout=10)[1], Hello)
        sent = time.monotonic()
        assert server.send(0, Abort())
        code = worker.wait(timeout=ABORT_GRACE + 10)
        took = time.monotonic() - sent
        _, err = worker.communicate(timeout=10)
        assert code == -signal.SIGKILL, err  # the agent restarts a killed worker alone
        assert ABORT_GRACE <= took < ABORT_GRACE + 5, took
        assert "the agent aborted the process group (a member is lost): 2 socket(s)" in err
        assert f"collective still waits {ABORT_GRACE:.1f} s after the abort" in err
        assert "its agent restarts it alone and it rejoins from its peers" in err
    finally:
        worker.kill()
        worker.wait(timeout=10)
        server.close()


def test_a_worker_waiting_for_its_plan_is_not_ended_by_an_abort() -> None:
    seen: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    server = ChannelServer(lambda rank, message: seen.put((rank, message)))
    worker = start("waiting", server)
    try:
        assert isinstance(seen.get(timeout=10)[1], Hello)
        assert worker.stdout is not None and worker.stdout.readline() == "waiting\n"
        assert server.send(0, Abort())
        # the abort's watch ends and leaves it alone (past the grace it would SIGKILL it)
        assert worker.stdout.readline() == "watched\n", worker.communicate(timeout=10)
        assert worker.poll() is None, worker.communicate(timeout=10)
    finally:
        worker.kill()
        worker.wait(timeout=10)
        server.close()


def test_a_group_creation_that_reconnected_after_the_abort_is_cut_not_the_worker() -> None:
    """An abort during a group's creation whose store client reconnects after it (as torch's
    does) and waits for peers that went on: past the grace the sockets it opened since are shut
    down too, the creation fails, and the worker waits for its next plan. It used to end
    itself, and its agent restarted it (seen under load: a recovery overlapping another
    node's failure to enter the new group)."""
    seen: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    server = ChannelServer(lambda rank, message: seen.put((rank, message)))
    worker = start("", server, CREATING)
    try:
        assert isinstance(seen.get(timeout=10)[1], Hello)
        assert server.send(0, Abort())
        assert worker.stdout is not None
        assert worker.stdout.readline() == "creation failed\n", worker.communicate(timeout=10)
        assert worker.stdout.readline() == "watched\n", worker.communicate(timeout=10)
        assert worker.poll() is None, worker.communicate(timeout=10)
    finally:
        worker.kill()
        _, err = worker.communicate(timeout=10)
        server.close()
    assert f"still waits {ABORT_GRACE:.1f} s after the abort, on 2 socket(s) it opened" in err
    assert "ends itself" not in err, err


def test_a_worker_told_to_leave_ends_quietly_when_its_agent_ended_first() -> None:
    """scancel of a whole job: every process gets SIGTERM at once. A worker in a collective runs
    its handler only once the collective fails, after its agent's end was seen: it ends as
    SIGTERM's default action would, not with a traceback about its agent."""

    def act(server: ChannelServer, worker: subprocess.Popen[str]) -> None:
        worker.send_signal(signal.SIGTERM)  # pending until the script unblocks it
        server.close()  # its agent ends

    ends_as_sigterm(TOLD_TO_LEAVE, act)


def test_a_worker_its_agent_stops_ends_quietly_when_the_agent_hangs_up_first() -> None:
    """The agent stops its workers: it says Stop on the channel, hangs up, then signals. A
    worker waiting for its plan sees the agent's end before the signal comes: it ends as the
    SIGTERM would, not with a traceback about its agent (seen once in a full run)."""

    def act(server: ChannelServer, worker: subprocess.Popen[str]) -> None:
        assert server.send(0, Stop())
        server.forget()  # hung up; no signal follows here

    ends_as_sigterm(STOPPED, act)


def ends_as_sigterm(script: str, act: Callable[[ChannelServer, subprocess.Popen[str]], None]) -> None:
    """Start ``script`` as a worker of a channel, ``act`` once it said Hello: it ends with
    SIGTERM's code (143) and no traceback."""
    seen: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    server = ChannelServer(lambda rank, message: seen.put((rank, message)))
    worker = start("", server, script)
    try:
        assert isinstance(seen.get(timeout=10)[1], Hello)
        act(server, worker)
        code = worker.wait(timeout=30)
        _, err = worker.communicate(timeout=10)
        assert code == 128 + signal.SIGTERM, err
        assert "Traceback" not in err, err
    finally:
        worker.kill()
        worker.wait(timeout=10)
        server.close()
