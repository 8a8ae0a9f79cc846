"""Where ``rdzv run`` runs: what it takes from Slurm (:mod:`._slurm`) or from a pod of a
Kubernetes Indexed Job (``rdzv run --print-config`` shows what and from where).

Kubernetes gives each pod of an Indexed Job its index (``JOB_COMPLETION_INDEX``, 0..N-1, kept by
a pod that replaces a failed one): it orders the newcomers of a round (the rendezvous option
``node_order``), so rank 0 is pod 0. The rest (run id, endpoint, this pod's address) is not in a
pod's environment unless the manifest puts it there: ``examples/kubernetes/`` maps the Job's uid
to ``PET_RDZV_ID`` and the pod's IP to ``PET_LOCAL_ADDR`` with the downward API, and names the
store's Service in ``PET_RDZV_ENDPOINT``.
"""

from __future__ import annotations

from typing import Mapping

from . import _slurm

KUBERNETES_INDEX = "JOB_COMPLETION_INDEX"


def derive(env: Mapping[str, str], given: Mapping[str, str | None]) -> dict[str, _slurm.Derived]:
    """The values taken from the scheduler, by flag name or rendezvous option (see
    :func:`._slurm.derive`); none outside Slurm and Kubernetes."""
    if _slurm.in_allocation(env):
        return _slurm.derive(env, given)
    if env.get(KUBERNETES_INDEX, "").isdigit():
        return {"node_order": (env[KUBERNETES_INDEX], f"Kubernetes: {KUBERNETES_INDEX}")}
    return {}
