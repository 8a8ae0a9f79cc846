"""What ``rdzv run`` takes from Kubernetes when it runs in a pod of an Indexed Job.

Kubernetes gives each pod of an Indexed Job its index (``JOB_COMPLETION_INDEX``, 0..N-1, kept by
a pod that replaces a failed one): it orders the newcomers of a round (the rendezvous option
``node_order``), so rank 0 is pod 0. The rest (run id, endpoint, this pod's address) is not in a
pod's environment unless the manifest puts it there: ``examples/kubernetes/`` maps the Job's name
to ``PET_RDZV_ID`` and the pod's IP to ``PET_LOCAL_ADDR`` with the downward API, and names the
store's Service in ``PET_RDZV_ENDPOINT``.
"""

from __future__ import annotations

from typing import Mapping

from ._slurm import Derived

INDEX = "JOB_COMPLETION_INDEX"


def in_indexed_job(env: Mapping[str, str]) -> bool:
    return env.get(INDEX, "").isdigit()


def derive(env: Mapping[str, str]) -> dict[str, Derived]:
    """The values ``rdzv run`` takes from an Indexed Job's pod (by rendezvous option name)."""
    return {"node_order": Derived(env[INDEX], f"Kubernetes: {INDEX}")}
