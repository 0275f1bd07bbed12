"""A multi-node update as a Kubeflow PyTorchJob: the manifest, and a launcher for KFP.

Argo creates the job with a resource template and waits on its status (see templates.update_template); KFP
has no resource templates, so its update task runs `python -m pipelines.workflow.pytorchjob`, which creates
the same manifest through the Kubernetes API and waits the same way.

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

import argparse
import copy
import json
import signal
import sys
import time
from typing import Any

import yaml

from pipelines.workflow import placement as pl
from steps.run_config import RunConfig

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
SUCCESS_CONDITION = "status.replicaStatuses.Master.succeeded > 0"
# Created, Running|Restarting, Suspended, Succeeded, Failed: at most five conditions, and a Failed one sits
# at index 1 to 4 (0 too, should a job miss its Created condition).
FAILED_CONDITION_INDEXES = range(5)
FAILURE_CONDITION = ", ".join(f"status.conditions.{i}.type == Failed" for i in FAILED_CONDITION_INDEXES)
# The operator fails a job that has been active this long (a hung collective, a rank that never joins);
# Argo's own deadline on the wait is a little longer, so that the job's comes first and cleans up its pods.
JOB_DEADLINE_SECONDS = 6 * 3600
WAIT_DEADLINE_SECONDS = JOB_DEADLINE_SECONDS + 600


def job_name(cfg: RunConfig, iteration: str) -> str:
    """The one PyTorchJob of a run's update-`iteration` (a DNS label: the run name is at most 40 characters)."""
    return f"{cfg.name}-update-{iteration}"


def torchrun_args(cfg: RunConfig, iteration: str) -> list[str]:
    t = cfg.trainer
    args = ["--nproc-per-node", str(t.nproc_per_node)]
    if t.nodes == 1:
        args += ["--standalone", "--nnodes", "1"]
    else:
        args += ["--nnodes", str(t.nodes)]
    # "--" ends torchrun's own options: its argparse would take the step's --run for an abbreviation of
    # --run-path ("ambiguous option"). torchrun drops the "--" before starting the script.
    return [*args, "-m", "steps.update", "--", "--run", cfg.run_store, "--iteration", iteration]


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


def job_outcome(job: dict[str, Any]) -> str | None:
    """'Succeeded', 'Failed' or None (still running), by the same rule as the Argo conditions above."""
    status = job.get("status", {})
    if status.get("replicaStatuses", {}).get("Master", {}).get("succeeded", 0) > 0:
        return "Succeeded"
    conditions = status.get("conditions", [])
    if any(conditions[i].get("type") == "Failed" for i in FAILED_CONDITION_INDEXES if i < len(conditions)):
        return "Failed"
    return None


def launch(job: dict[str, Any], namespace: str, poll_seconds: float = 10.0, api: Any = None) -> int:
    """Replace any job of this name, wait for the new one (up to WAIT_DEADLINE_SECONDS), delete it unless it
    succeeded; 0 iff it succeeded. The same lifecycle as the Argo update step."""
    if api is None:
        from kubernetes import client, config  # imported here: only KFP's launcher pod needs it

        config.load_incluster_config()
        api = client.CustomObjectsApi()
    name = job["metadata"]["name"]
    foreground = {"propagation_policy": "Foreground"}

    def delete() -> None:
        try:
            api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, **foreground)
        except Exception as err:  # noqa: BLE001 - kubernetes' ApiException; absent is what we want
            if getattr(err, "status", None) != 404:
                raise

    def gone() -> bool:
        try:
            api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except Exception as err:  # noqa: BLE001
            if getattr(err, "status", None) == 404:
                return True
            raise
        return False

    delete()
    while not gone():
        time.sleep(poll_seconds)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
    print(f"created PyTorchJob {namespace}/{name}", flush=True)

    def stop(signum: int, frame: object) -> None:
        delete()
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + WAIT_DEADLINE_SECONDS
    try:
        while True:
            outcome = job_outcome(api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
            if outcome is None and time.monotonic() > deadline:
                outcome = f"Failed (still running after {WAIT_DEADLINE_SECONDS} s)"
            if outcome is not None:
                print(f"PyTorchJob {name}: {outcome}", flush=True)
                if outcome != "Succeeded":
                    delete()
                return 0 if outcome == "Succeeded" else 1
            time.sleep(poll_seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.workflow.pytorchjob", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--manifest-json", required=True, help="the PyTorchJob to create, as JSON")
    parser.add_argument("--namespace", required=True)
    args = parser.parse_args()
    return launch(json.loads(args.manifest_json), args.namespace)


if __name__ == "__main__":
    from steps.errors import run_cli

    run_cli(main)
