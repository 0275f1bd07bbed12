"""A multi-node update as a Kubeflow PyTorchJob: the manifest, and a launcher for KFP.

Argo creates the job with a resource template and waits on its status (see templates.update_template); KFP
has no resource templates, so its update task runs `python -m pipelines.workflow.pytorchjob`, which creates
the same manifest through the Kubernetes API and waits the same way.

Every replica runs the same torchrun command as the single-node update. With `nprocPerNode` set, the training
operator gives each pod PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT, which torchrun reads.
restartPolicy OnFailure restarts a crashed rank in place (the update starts over from its published inputs)
up to runPolicy.backoffLimit times.

Completion is read from status.replicaStatuses: Argo parses success/failure conditions as Kubernetes label
selectors, whose keys cannot hold a gjson query over the status.conditions list, and the operator keeps the
Master's succeeded/failed counts in step with its Succeeded/Failed conditions.
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

from pipelines.config import RunConfig
from pipelines.workflow import placement as pl

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
SUCCESS_CONDITION = "status.replicaStatuses.Master.succeeded > 0"
# Argo fails the step when any one of these requirements holds.
FAILURE_CONDITION = "status.replicaStatuses.Master.failed > 0, status.replicaStatuses.Worker.failed > 0"


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
        "metadata": {"generateName": f"{cfg.name}-update-{iteration}-", "labels": dict(pod_labels)},
        "spec": {
            "nprocPerNode": str(cfg.trainer.nproc_per_node),
            "runPolicy": {"backoffLimit": cfg.retries["trainer"].limit, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def _without_empty(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v not in (None, {}, [])}


def manifest_yaml(cfg: RunConfig, iteration: str) -> str:
    return yaml.safe_dump(manifest(cfg, iteration), sort_keys=False)


def job_outcome(job: dict[str, Any]) -> str | None:
    """'Succeeded', 'Failed' or None (still running), by the same rule as the Argo conditions above."""
    statuses = job.get("status", {}).get("replicaStatuses", {})
    if statuses.get("Master", {}).get("succeeded", 0) > 0:
        return "Succeeded"
    if any(statuses.get(r, {}).get("failed", 0) > 0 for r in ("Master", "Worker")):
        return "Failed"
    for condition in job.get("status", {}).get("conditions", []):
        if condition.get("type") in ("Succeeded", "Failed") and condition.get("status") == "True":
            return condition["type"]
    return None


def launch(job: dict[str, Any], namespace: str, poll_seconds: float = 10.0) -> int:
    """Create the PyTorchJob, wait for it, delete it if we are stopped; 0 iff it succeeded."""
    from kubernetes import client, config  # imported here: only KFP's launcher pod needs it

    config.load_incluster_config()
    api = client.CustomObjectsApi()
    created = api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
    name = created["metadata"]["name"]
    print(f"created PyTorchJob {namespace}/{name}", flush=True)

    def stop(signum: int, frame: object) -> None:
        api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    while True:
        outcome = job_outcome(api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
        if outcome is not None:
            print(f"PyTorchJob {name}: {outcome}", flush=True)
            return 0 if outcome == "Succeeded" else 1
        time.sleep(poll_seconds)


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
