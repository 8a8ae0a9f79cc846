"""The Kubernetes manifests of ``examples/kubernetes``: every container runs a valid ``rdzv``
command, ``rdzv run`` derives from a pod's environment what the manifest says it does (shown by
``--print-config``, run for real with the pod's environment), and the pieces fit each other
(the Service's ports, the secret's path, the grace period against ``--leave-grace``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from rdzv.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "examples" / "kubernetes").glob("*.yaml"))
POD_IP = "10.1.2.3"
JOB_UID = "0c5f1d2e-9a7b-4c3d-8e6f-112233445566"
INDEX = "1"


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def pod_templates() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(the workload, its pod spec) of every Deployment and Job."""
    for doc in documents():
        if doc["kind"] in ("Deployment", "Job"):
            yield doc, doc["spec"]["template"]["spec"]


def containers() -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    return [(workload, pod, container) for workload, pod in pod_templates()
            for container in pod["containers"]]


def command(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def pod_env(workload: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes would set it in pod ``INDEX`` of the workload."""
    env = {"JOB_COMPLETION_INDEX": INDEX} if workload["kind"] == "Job" else {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        known = {"metadata.labels['batch.kubernetes.io/controller-uid']": JOB_UID,
                 "status.podIP": POD_IP}
        assert path in known, f"a fieldRef this test does not know: {path}"
        env[item["name"]] = known[path]
    return env


def option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_examples_hold_a_store_and_an_indexed_job() -> None:
    kinds = sorted(doc["kind"] for doc in documents())
    assert kinds == ["Deployment", "Job", "Service"]
    job = next(doc for doc in documents() if doc["kind"] == "Job")
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"]


@pytest.mark.parametrize("index", range(len(containers())))
def test_every_container_runs_a_valid_rdzv_command(index: int) -> None:
    _workload, _pod, container = containers()[index]
    argv = command(container)
    assert argv[0] == "rdzv", argv
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as exc:  # argparse said what is wrong on stderr
        pytest.fail(f"{' '.join(argv)} is not a valid rdzv command (exit {exc.code})")
    assert args.command in ("run", "serve")


def test_rdzv_run_in_a_pod_derives_what_the_manifest_says(tmp_path: Path) -> None:
    workload, pod, container = next(c for c in containers() if command(c[2])[:2] == ["rdzv", "run"])
    argv = command(container)
    done = subprocess.run([sys.executable, "-m", "rdzv", "run", "--print-config", *argv[2:]],
                          env={"PATH": "/usr/bin:/bin", **pod_env(workload, container)},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    lines = {line.split("  ")[0]: " ".join(line.split()) for line in done.stdout.splitlines()}
    assert lines["rdzv_id"] == f"rdzv_id {JOB_UID} (PET_RDZV_ID)"
    assert lines["local_addr"] == f"local_addr {POD_IP} (PET_LOCAL_ADDR)"
    assert lines["rdzv_conf node_order"] == (f"rdzv_conf node_order {INDEX} (Kubernetes: "
                                             "JOB_COMPLETION_INDEX)")
    assert lines["nnodes"] == "nnodes 2:4 (--nnodes)"
    # the store is the Service of rdzv-store.yaml, on its port, with its secret
    host, _, port = option(argv, "--rdzv-endpoint").partition(":")
    service = next(doc for doc in documents() if doc["kind"] == "Service")
    assert host == service["metadata"]["name"]
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert lines["rdzv_conf secret_file"].startswith("rdzv_conf secret_file /etc/rdzv/secret ")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["secret"] == "/etc/rdzv"
    # SIGKILL comes terminationGracePeriodSeconds after SIGTERM: the leave must fit within it
    assert pod["terminationGracePeriodSeconds"] > float(option(argv, "--leave-grace"))


def test_the_store_serves_what_the_service_exposes() -> None:
    (_workload, _pod, container), = [c for c in containers()
                                     if command(c[2])[:2] == ["rdzv", "serve"]]
    args = command(container)
    service = next(doc for doc in documents() if doc["kind"] == "Service")
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in named
    assert named["store"] == int(option(args, "--port"))
    assert option(args, "--secret-file") == "/etc/rdzv/secret"
    assert option(args, "--web").endswith(f":{named['web']}")
