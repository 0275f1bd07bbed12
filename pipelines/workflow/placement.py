"""Where pods run, as plain Kubernetes JSON: one source for Argo templates, PyTorchJob pods and KFP tasks."""

from __future__ import annotations

from typing import Any

from steps.run.config import Placement, RunConfig

RUN_LABEL = "moerl.io/run"
STEP_LABEL = "moerl.io/step"
ITERATION_LABEL = "moerl.io/iteration"
SEGMENT_LABEL = "moerl.io/segment"
# Karpenter never consolidates or drifts a node away from under a pod with this annotation: a trainer pod
# holds state that only a finished update publishes, so losing it costs the whole step.
DO_NOT_DISRUPT = {"karpenter.sh/do-not-disrupt": "true"}
SHM_VOLUME = "dshm"
TMP_VOLUME = "tmp"
# Every step: logs unbuffered (Argo shows them live) and never a download from the Hugging Face hub.
STEP_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
# The images' own user and group (ARG MOERL_UID / MOERL_GID in images/*/Dockerfile; tests/test_images.py keeps
# them equal). Numeric, so that the kubelet can check runAsNonRoot without reading /etc/passwd in the image.
RUN_AS_UID = 10001
RUN_AS_GID = 10001
# The root filesystem is read-only, so the image's home is too: HOME points into the /tmp volume, where the
# images already keep their caches (XDG_CACHE_HOME, TRITON_CACHE_DIR, EP_JIT_CACHE_DIR under /tmp/cache).
READ_ONLY_ROOT_ENV = {"HOME": "/tmp"}


# Karpenter's capacity types (karpenter.sh/capacity-type): a node launched into a capacity reservation (an
# ODCR that the EC2NodeClass selects, or an EC2 Capacity Block for ML) is labelled `reserved`, not
# `on-demand`, so a role off Spot runs on either.
SPOT_CAPACITY = ("spot",)
NON_SPOT_CAPACITY = ("on-demand", "reserved")


def node_selector(cfg: RunConfig, role: str) -> dict[str, str]:
    """The role's node selector; a Spot role is pinned to Spot capacity by cfg.capacity_label (the others
    by node_affinity: a node selector holds one value)."""
    p = cfg.placement[role]
    out = dict(p.node_selector)
    if cfg.capacity_label is not None and cfg.capacity_label not in out and p.spot:
        out[cfg.capacity_label] = SPOT_CAPACITY[0]
    return out


def node_affinity(cfg: RunConfig, role: str) -> dict[str, Any] | None:
    """A role off Spot: a required node affinity to on-demand or reserved capacity (None for Spot roles, or
    when the role's node_selector names the capacity label itself, or there is no capacity label)."""
    p = cfg.placement[role]
    if cfg.capacity_label is None or cfg.capacity_label in p.node_selector or p.spot:
        return None
    term = {"matchExpressions": [{"key": cfg.capacity_label, "operator": "In", "values": list(NON_SPOT_CAPACITY)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def tolerations(p: Placement) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in p.tolerations]


def resources(p: Placement) -> dict[str, dict[str, str]]:
    out = {}
    for kind in ("requests", "limits"):
        values = getattr(p.resources, kind)
        if values:
            out[kind] = {name: str(q) for name, q in values.items()}
    return out


def volumes(p: Placement) -> list[dict[str, Any]]:
    """/tmp, the one writable place under a read-only root filesystem (temp files, the checkpoint cache, step
    outputs that Argo reads back), and /dev/shm as a memory-backed emptyDir where the role asks for one: the
    container runtime's 64 MB default stalls NCCL and torchrun."""
    out: list[dict[str, Any]] = [{"name": TMP_VOLUME, "emptyDir": {}}]
    if p.shm_size is not None:
        out.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": p.shm_size}})
    return out


def volume_mounts(p: Placement) -> list[dict[str, Any]]:
    out = [{"name": TMP_VOLUME, "mountPath": "/tmp"}]
    if p.shm_size is not None:
        out.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    return out


def pod_security_context() -> dict[str, Any]:
    """Every step pod runs as the images' non-root user under the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "runAsGroup": RUN_AS_GID,
        "fsGroup": RUN_AS_GID,  # the emptyDir volumes belong to the step's group
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """No writes outside the volumes, no setuid escalation, no Linux capabilities (the GPUs and EFA devices
    come from device plugins, which need none in the container)."""
    return {
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def labels(cfg: RunConfig, step: str, iteration: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "moerl", RUN_LABEL: cfg.name, STEP_LABEL: step}
    if iteration is not None:
        out[ITERATION_LABEL] = iteration
    return out


def annotations(role: str) -> dict[str, str]:
    return dict(DO_NOT_DISRUPT) if role == "trainer" else {}


# The MLflow client's own variables (mlflow.environment_variables), taken from tracking.mlflow.secret.
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
                      "MLFLOW_TRACKING_PASSWORD")  # fmt: skip


def tracking_env(cfg: RunConfig) -> list[dict[str, Any]]:
    """The env of the steps that log to trackers (score, update, report): credentials as secretKeyRefs,
    never values. Optional refs: a missing Secret leaves the variable unset, and a tracker without
    credentials is skipped with a warning instead of the pod failing to start."""
    out: list[dict[str, Any]] = []
    mlflow, wandb = cfg.tracking.mlflow, cfg.tracking.wandb
    if mlflow is not None and mlflow.secret is not None:
        for key in MLFLOW_SECRET_KEYS:
            if key == "MLFLOW_TRACKING_URI" and mlflow.tracking_uri is not None:
                continue  # the config names the server; the client takes it from there
            ref = {"name": mlflow.secret, "key": key, "optional": True}
            out.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    if wandb is not None and wandb.api_key_secret is not None:
        ref = {"name": wandb.api_key_secret, "key": wandb.api_key_secret_key, "optional": True}
        out.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": ref}})
    return out


# A long-lived server's own address (steps/run/serving.py pod_ip), from the downward API: the server registers it.
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def env() -> list[dict[str, str]]:
    """The environment of every step pod with a read-only root filesystem (Argo templates, PyTorchJob pods)."""
    return [{"name": k, "value": v} for k, v in (STEP_ENV | READ_ONLY_ROOT_ENV).items()]
