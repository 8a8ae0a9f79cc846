"""What one node's part of a tcp rendezvous round costs its client, in instructions.

Wall times of ``bench/rendezvous.py`` move by 10-30% from run to run on a shared machine, too
much to see a change of a few percent. This counts instead: N nodes, threads of one process,
join R rounds (a fresh handler each, ``min_nodes = max_nodes = N``) against ``rdzv serve`` in a
process of its own, under ``valgrind --tool=callgrind``, which counts every instruction the
client process runs (its threads one at a time: the count is the same to about 0.5% from run to
run). The same run without its rounds (handlers made, no ``next_rendezvous``) is subtracted, and
the rest divided by N x R::

    python bench/round_cost.py --nodes 32 --rounds 3            # this tree (needs valgrind)
    PYTHONPATH=/other/tree/src python bench/round_cost.py ...   # another tree, to compare

``--rdzv-conf history_size=0`` passes rendezvous options (to see what a feature costs).
The server's own work is not counted (it runs outside valgrind).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.abspath(__file__)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def rounds(nodes: int, count: int, join: bool, conf: dict[str, str]) -> None:
    """(Under valgrind.) Make the handlers of ``count`` rounds; with ``join``, run the rounds."""
    from rdzv.rendezvous import RendezvousParameters, get_rendezvous_handler

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "rdzv", "serve", "--host", "127.0.0.1",
                               "--port", str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        for r in range(count):
            handlers = [get_rendezvous_handler(RendezvousParameters(
                "tcp", f"127.0.0.1:{port}", f"cost{r}", nodes, nodes, local_addr="127.0.0.1",
                is_host=False, **conf)) for _ in range(nodes)]
            if join:
                threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(600)
    finally:
        server.kill()
        server.wait()
    sys.stdout.flush()
    os._exit(0)  # (the handlers' shutdown is not part of a round)


def count(args: argparse.Namespace, join: bool) -> int:
    """Instructions of one run under callgrind."""
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
               HERE, "--inside", "join" if join else "make", "--nodes", str(args.nodes),
               "--rounds", str(args.rounds), "--rdzv-conf", args.rdzv_conf]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    for line in done.stderr.splitlines():
        if "Collected :" in line:
            return int(line.rsplit(":", 1)[1])
    raise SystemExit(f"round_cost: valgrind gave no count (exit {done.returncode}):\n"
                     f"{done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rdzv-conf", default="", help="KEY=VALUE,... rendezvous options")
    parser.add_argument("--inside", choices=["make", "join"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if item)
    if args.inside:
        rounds(args.nodes, args.rounds, args.inside == "join", conf)
    if shutil.which("valgrind") is None:
        raise SystemExit("round_cost: needs valgrind (apt-get install valgrind)")
    made, joined = count(args, False), count(args, True)
    per = (joined - made) / (args.nodes * args.rounds)
    import rdzv

    print(f"rdzv {rdzv.__version__} from {os.path.dirname(rdzv.__file__)}; "
          f"{args.nodes} nodes x {args.rounds} rounds, options {conf or '-'}")
    print(f"client instructions per node-round: {per / 1000:.0f}k "
          f"(runs: {made:,} without the rounds, {joined:,} with them)")


if __name__ == "__main__":
    main()
