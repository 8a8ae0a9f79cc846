"""Where ``rdzv run`` runs: what it takes from Slurm (:mod:`._slurm`) or from a pod of a
Kubernetes Indexed Job, and ``--print-config``'s account of where each value came from.

Kubernetes gives each pod of an Indexed Job its index (``JOB_COMPLETION_INDEX``, 0..N-1, kept by
a pod that replaces a failed one): it orders the newcomers of a round (the rendezvous option
``node_order``), so rank 0 is pod 0. The rest (run id, endpoint, this pod's address) is not in a
pod's environment unless the manifest puts it there: ``examples/kubernetes/`` maps the Job's uid
to ``PET_RDZV_ID`` and the pod's IP to ``PET_LOCAL_ADDR`` with the downward API, and names the
store's Service in ``PET_RDZV_ENDPOINT``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from . import _slurm

if TYPE_CHECKING:
    from ._config import LaunchConfig

KUBERNETES_INDEX = "JOB_COMPLETION_INDEX"


def derive(env: Mapping[str, str], given: Mapping[str, str | None]) -> dict[str, _slurm.Derived]:
    """The values taken from the scheduler, by flag name or rendezvous option (see
    :func:`._slurm.derive`); none outside Slurm and Kubernetes."""
    if _slurm.in_allocation(env):
        return _slurm.derive(env, given)
    if env.get(KUBERNETES_INDEX, "").isdigit():
        return {"node_order": (env[KUBERNETES_INDEX], f"Kubernetes: {KUBERNETES_INDEX}")}
    return {}


def describe(config: LaunchConfig) -> str:
    """``rdzv run --print-config``: each value this node runs with, and where it came from."""
    origins = config.origins
    nnodes = (str(config.min_nodes) if config.min_nodes == config.max_nodes
              else f"{config.min_nodes}:{config.max_nodes}")
    rows = [
        ("nnodes", nnodes, origins.get("nnodes", "default")),
        ("nproc_per_node", str(config.nproc_per_node), origins.get("nproc_per_node", "default")),
        ("rdzv_backend", config.rdzv_backend, origins.get("rdzv_backend", "default")),
        ("rdzv_endpoint", config.rdzv_endpoint or "(none)",
         origins.get("rdzv_endpoint", "default")),
        ("rdzv_id", config.run_id, origins.get("rdzv_id", "default")),
        ("local_addr", config.local_addr or "(this machine's name)",
         origins.get("local_addr", "default")),
    ]
    for key, value in sorted(config.rdzv_conf.items()):
        rows.append((f"rdzv_conf {key}", value, origins.get(f"rdzv_conf:{key}", "default")))
    value_width = max(len(value) for _n, value, _o in rows)
    rows.append(("command", " ".join(config.command), "TRAINING_SCRIPT"))
    width = max(len(name) for name, _v, _o in rows)
    return "\n".join(f"{name:<{width}}  {value:<{value_width}}  ({origin})"
                     for name, value, origin in rows)
