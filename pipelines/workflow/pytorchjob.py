"""A multi-node update as a Kubeflow PyTorchJob: the manifest and the conditions a wait judges it by.

Argo creates the job with a resource template and waits on its status (see templates.update_template); KFP
has no resource templates, so its update task runs the launcher pod `python -m steps.pytorchjob_launcher`,
which creates the same manifest through the Kubernetes API and waits the same way (its `job_outcome` reads
the conditions below).

Every replica runs the same torchrun command as the single-node update. With `nprocPerNode` set, the training
operator gives each pod PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, which torchrun reads.

What the training operator (kubeflow/trainer v1.9.4, pkg/controller.v1/common/{pod,job}.go) does, and what
that means for the wait:
  - restartPolicy OnFailure: a crashed container restarts inside its Running pod (kubelet), and a pod that
    failed as a whole (its node lost) is deleted and recreated; either way the job goes on and
    replicaStatuses.*.failed says nothing final (it rises for a lost pod that is being replaced, and stays
    0 for a container that crashes in place). What is final is the job's `Failed` condition: set once
    runPolicy.backoffLimit restarts are spent or runPolicy.activeDeadlineSeconds has passed, after which no
    condition changes again. The Master's `succeeded` count is final the same way.
  - Conditions are a list, each type at most once, appended in the order they arise: Created first, then
    Running or Restarting (they replace each other), Suspended, Succeeded or Failed. Argo reads success and
    failure conditions as Kubernetes label selectors over gjson paths, whose keys cannot hold a gjson query
    (`#(type=="Failed")`), so the failure condition names every index a Failed condition can hold; Argo
    fails the step when any one of those requirements holds.
  - cleanPodPolicy Running: when the job ends (failed included) its still-running pods are deleted, so a
    failed job frees its nodes and stops writing candidates at once.
  - The job's name is fixed per run and iteration (JOB_NAME), so there is never more than one per
    iteration: the workflow's update step deletes it (and waits until its pods are gone) before it creates
    it, on every attempt, and a resubmitted run replaces the job of a run before it instead of racing it.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from pipelines.workflow import placement as pl
from pipelines.workflow.commands import torchrun_args
from steps.pytorchjob_launcher import (
    FAILED_CONDITION_INDEXES,
    GROUP,
    JOB_DEADLINE_SECONDS,
    VERSION,
)
from steps.run_config import RunConfig

SUCCESS_CONDITION = "status.replicaStatuses.Master.succeeded > 0"
FAILURE_CONDITION = ", ".join(f"status.conditions.{i}.type == Failed" for i in FAILED_CONDITION_INDEXES)


def job_name(cfg: RunConfig, iteration: str) -> str:
    """The one PyTorchJob of a run's update-`iteration` (a DNS label: the run name is at most 40 characters)."""
    return f"{cfg.name}-update-{iteration}"


def manifest(cfg: RunConfig, iteration: str) -> dict[str, Any]:
    """The PyTorchJob of update-`iteration` (iteration may be an Argo expression such as {{inputs...}})."""
    p = cfg.placement["trainer"]
    pod_labels = pl.labels(cfg, "update", iteration)
    container = _without_empty(
        {
            "name": "pytorch",  # the training operator looks for this container name
            "image": cfg.images.trainer,
            "command": ["torchrun"],
            "args": torchrun_args(cfg, iteration),
            "env": pl.env() + pl.tracking_env(cfg),
            "resources": pl.resources(p),
            "volumeMounts": pl.volume_mounts(p),
            "securityContext": pl.container_security_context(),
        }
    )
    pod_spec = _without_empty(
        {
            "serviceAccountName": cfg.service_account,
            "priorityClassName": p.priority_class,
            "nodeSelector": pl.node_selector(cfg, "trainer"),
            "affinity": pl.node_affinity(cfg, "trainer"),
            "tolerations": pl.tolerations(p),
            "securityContext": pl.pod_security_context(),
            "containers": [container],
            "volumes": pl.volumes(p),
        }
    )

    def replica(count: int) -> dict[str, Any]:
        metadata = {"labels": dict(pod_labels), "annotations": pl.annotations("trainer")}
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": copy.deepcopy({"metadata": metadata, "spec": pod_spec}),
        }

    specs = {"Master": replica(1)}
    if cfg.trainer.nodes > 1:
        specs["Worker"] = replica(cfg.trainer.nodes - 1)
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PyTorchJob",
        "metadata": {"name": job_name(cfg, iteration), "labels": dict(pod_labels)},
        "spec": {
            "nprocPerNode": str(cfg.trainer.nproc_per_node),
            "runPolicy": {
                "backoffLimit": cfg.retries["trainer"].limit,
                "activeDeadlineSeconds": JOB_DEADLINE_SECONDS,
                "cleanPodPolicy": "Running",
            },
            "pytorchReplicaSpecs": specs,
        },
    }


def reference(cfg: RunConfig, iteration: str) -> dict[str, Any]:
    """Just enough of the job for `kubectl delete -f`: its kind and name."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PyTorchJob", "metadata": {"name": job_name(cfg, iteration)}}


def _without_empty(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v not in (None, {}, [])}


def manifest_yaml(cfg: RunConfig, iteration: str) -> str:
    return yaml.safe_dump(manifest(cfg, iteration), sort_keys=False)
