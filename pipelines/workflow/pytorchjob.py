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
  - A cold start: the operator gives every Worker pod an init container `init-pytorch`, appended after the
    pod template's own (pytorch/initcontainer.go setInitContainer), that runs `nslookup <job>-master-0` at
    most PyTorchInitContainerMaxTries = 100 times, 2 s apart (pkg/config/config.go, initContainerTemplate),
    and the master's headless Service (common/service.go CreateNewService, no publishNotReadyAddresses) has
    an address only once the master pod is Ready, i.e. its image pulled and its container started. A master
    whose node or image comes more than ~200 s after a worker's would fail that init container; under
    restartPolicy Never that fails the pod and the job (pytorchjob_controller.go UpdateJobStatus: a failed
    replica with restartPolicy Never sets Failed). OnFailure would let the kubelet rerun it, but
    core/job.go PastBackoffLimit counts init-container restarts against backoffLimit as soon as the pod
    runs, and ExitCode fails the job on any new failed pod once backoffLimit is spent (common/job.go
    ReconcileJobs: exceedsBackoffLimit). So every Worker waits first in an init container of its own
    (`wait-for-master`: `python -m steps.pytorchjob_launcher --wait-for-host <job>-master-0`, up to
    MASTER_WAIT_SECONDS), after which the operator's resolves at its first try; the restart policies keep
    their meaning.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from pipelines.workflow import placement as pl
from pipelines.workflow.commands import flags, torchrun_args, trainer_server_args
from steps.pytorchjob_launcher import (
    FAILED_CONDITION_INDEXES,
    GROUP,
    HEARTBEAT_KEY_ANNOTATION,
    HEARTBEAT_STORE_ANNOTATION,
    JOB_DEADLINE_SECONDS,
    MASTER_WAIT_SECONDS,
    VERSION,
)
from steps.run.config import RunConfig
from steps.run.keys import launcher_heartbeat_key

SUCCESS_CONDITION = "status.replicaStatuses.Master.succeeded > 0"
FAILURE_CONDITION = ", ".join(f"status.conditions.{i}.type == Failed" for i in FAILED_CONDITION_INDEXES)


def job_name(cfg: RunConfig, iteration: str) -> str:
    """The one PyTorchJob of a run's update-`iteration` (a DNS label: the run name is at most 40 characters)."""
    return f"{cfg.name}-update-{iteration}"


def manifest(cfg: RunConfig, iteration: str) -> dict[str, Any]:
    """The PyTorchJob of update-`iteration` (iteration may be an Argo expression such as {{inputs...}})."""
    run_policy = {
        "backoffLimit": cfg.retries["trainer"].limit,
        "activeDeadlineSeconds": JOB_DEADLINE_SECONDS,
        "cleanPodPolicy": "Running",
    }
    labels = pl.labels(cfg, "update", iteration)
    return _job(cfg, job_name(cfg, iteration), labels, torchrun_args(cfg, iteration), run_policy, "OnFailure")


def trainer_server_job_name(cfg: RunConfig) -> str:
    """The one PyTorchJob of a run's trainer that stays up (a segment's; the next segment's replaces it)."""
    return f"{cfg.name}-trainer-server"


def trainer_server_manifest(cfg: RunConfig, workflow: str, workflow_uid: str) -> dict[str, Any]:
    """The PyTorchJob of a multi-node trainer that stays up, which the segment's trainer-server daemon creates
    (steps/pytorchjob_launcher.py) and deletes when Argo stops it.

    restartPolicy Never and backoffLimit 0: the first replica that fails fails the job (the operator's rule
    for any replica type), its other pods are deleted, and the daemon exits 1, so the restart is the daemon's
    own retry, visible in the Workflow, never a replica restarted alone into a process group that is gone.
    No activeDeadlineSeconds: the job lives as long as its segment. The launcher rewrites a heartbeat in the run
    store at every poll (named by the job's annotations, steps/pytorchjob_launcher.py heartbeat_writer); should
    the daemon be killed before it could delete the job, the trainer ends itself once that heartbeat has been
    still for trainer.server_idle_exit_s (however long updates pause, a live launcher keeps it), and the owner
    reference to the Workflow removes it with the Workflow."""
    run_policy = {"backoffLimit": 0, "cleanPodPolicy": "Running"}
    labels = pl.labels(cfg, "trainer-server")
    env = [dict(pl.POD_IP_ENV)]  # rank 0 registers it
    args = trainer_server_args(cfg, workflow) + flags(idle_exit_s=cfg.trainer.server_idle_exit_s)
    job = _job(cfg, trainer_server_job_name(cfg), labels, args, run_policy, "Never", env)
    job["metadata"]["annotations"] = {
        HEARTBEAT_STORE_ANNOTATION: cfg.run_store,
        HEARTBEAT_KEY_ANNOTATION: launcher_heartbeat_key(workflow),
    }
    job["metadata"]["ownerReferences"] = [
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": workflow, "uid": workflow_uid}
    ]
    return job


def _job(
    cfg: RunConfig,
    name: str,
    pod_labels: dict[str, str],
    args: list[str],
    run_policy: dict[str, Any],
    restart_policy: str,
    extra_env: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A PyTorchJob of trainer.nodes replicas (1 Master, the rest Workers), each a pod on a trainer node that
    runs `torchrun args`."""
    p = cfg.placement["trainer"]
    container = _without_empty(
        {
            "name": "pytorch",  # the training operator looks for this container name
            "image": cfg.images.trainer,
            "command": ["torchrun"],
            "args": args,
            "env": pl.env() + pl.tracking_env(cfg) + (extra_env or []),
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

    def replica(count: int, init_containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        metadata = {"labels": dict(pod_labels), "annotations": pl.annotations("trainer")}
        spec = {**pod_spec, "initContainers": init_containers} if init_containers else pod_spec
        return {
            "replicas": count,
            "restartPolicy": restart_policy,
            "template": copy.deepcopy({"metadata": metadata, "spec": spec}),
        }

    specs = {"Master": replica(1)}
    if cfg.trainer.nodes > 1:
        specs["Worker"] = replica(cfg.trainer.nodes - 1, [wait_for_master(cfg, name)])
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": dict(pod_labels)},
        "spec": {
            "nprocPerNode": str(cfg.trainer.nproc_per_node),
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": specs,
        },
    }


def master_service(name: str) -> str:
    """The master's Service name, which the operator gives its Workers (kubeflow/trainer v1.9.4
    pkg/controller.v1/pytorch/envvar.go replicaName(job, Master, 0))."""
    return f"{name}-master-0"


def wait_for_master(cfg: RunConfig, name: str) -> dict[str, Any]:
    """A Worker's first init container: wait until the master's Service resolves (see the module docstring),
    with the trainer image the pod pulls anyway and the pod's own security context."""
    return _without_empty(
        {
            "name": "wait-for-master",
            "image": cfg.images.trainer,
            "command": ["python", "-m", "steps.pytorchjob_launcher"],
            "args": ["--wait-for-host", master_service(name), "--wait-seconds", str(MASTER_WAIT_SECONDS)],
            "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}},
            "securityContext": pl.container_security_context(),
        }
    )


def reference(cfg: RunConfig, iteration: str) -> dict[str, Any]:
    """Just enough of the job for `kubectl delete -f`: its kind and name."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PyTorchJob", "metadata": {"name": job_name(cfg, iteration)}}


def _without_empty(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v not in (None, {}, [])}


def manifest_yaml(cfg: RunConfig, iteration: str) -> str:
    return yaml.safe_dump(manifest(cfg, iteration), sort_keys=False)
