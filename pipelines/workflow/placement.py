"""Where pods run, as plain Kubernetes JSON: one source for Argo templates, PyTorchJob pods and KFP tasks."""

from __future__ import annotations

from typing import Any

from pipelines.config import Placement, RunConfig

RUN_LABEL = "moerl.io/run"
STEP_LABEL = "moerl.io/step"
ITERATION_LABEL = "moerl.io/iteration"
SEGMENT_LABEL = "moerl.io/segment"
# Karpenter never consolidates or drifts a node away from under a pod with this annotation: a trainer pod
# holds state that only a finished update publishes, so losing it costs the whole step.
DO_NOT_DISRUPT = {"karpenter.sh/do-not-disrupt": "true"}
SHM_VOLUME = "dshm"
# Every step: logs unbuffered (Argo shows them live) and never a download from the Hugging Face hub.
STEP_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def node_selector(cfg: RunConfig, role: str) -> dict[str, str]:
    """The role's node selector, pinned to Spot or on-demand capacity by cfg.capacity_label."""
    p = cfg.placement[role]
    out = dict(p.node_selector)
    if cfg.capacity_label is not None and cfg.capacity_label not in out:
        out[cfg.capacity_label] = "spot" if p.spot else "on-demand"
    return out


def tolerations(p: Placement) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in p.tolerations]


def resources(p: Placement) -> dict[str, dict[str, str]]:
    out = {}
    for kind in ("requests", "limits"):
        values = getattr(p.resources, kind)
        if values:
            out[kind] = {name: str(q) for name, q in values.items()}
    return out


def shm_volumes(p: Placement) -> list[dict[str, Any]]:
    """/dev/shm as a memory-backed emptyDir: the container runtime's 64 MB default stalls NCCL and torchrun."""
    if p.shm_size is None:
        return []
    return [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": p.shm_size}}]


def shm_mounts(p: Placement) -> list[dict[str, Any]]:
    return [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}] if p.shm_size is not None else []


def labels(cfg: RunConfig, step: str, iteration: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "moerl", RUN_LABEL: cfg.name, STEP_LABEL: step}
    if iteration is not None:
        out[ITERATION_LABEL] = iteration
    return out


def annotations(role: str) -> dict[str, str]:
    return dict(DO_NOT_DISRUPT) if role == "trainer" else {}


def env() -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in STEP_ENV.items()]
