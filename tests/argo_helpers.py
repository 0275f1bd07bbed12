"""Small builders and readers for the local executor's tests: a Workflow around some templates, a shell
container, a step, parameters, and a finished run's nodes and pod logs."""

from __future__ import annotations

from pathlib import Path

from pipelines.local import run_workflow
from pipelines.local.api.status import pod_name


def workflow(templates: list[dict], entrypoint: str = "main", **spec) -> dict:
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "t-"},
        "spec": {"entrypoint": entrypoint, "templates": templates, **spec},
    }


def sh(name: str, script: str, mounts: dict | None = None, **fields) -> dict:
    """A container template that runs `sh -c script`; mounts: volume name -> mountPath."""
    container = {"image": "alpine", "command": ["sh", "-c", script]}
    if mounts:
        container["volumeMounts"] = [{"name": volume, "mountPath": path} for volume, path in mounts.items()]
    return {"name": name, "container": container, **fields}


def step(name: str, template: str, **fields) -> dict:
    return {"name": name, "template": template, **fields}


def params(**values: str) -> dict:
    return {"parameters": [{"name": k, "value": v} for k, v in values.items()]}


def run(manifest: dict | Path, workdir: Path, **kwargs):
    """Run a Workflow to its end; returns the result and its nodes by display name."""
    result = run_workflow(manifest, workdir=workdir, view=None, **kwargs)
    nodes = {n["displayName"]: n for n in result.status["nodes"].values()}
    return result, nodes


def pod_dir(result, node: dict) -> Path:
    return result.run_dir / "pods" / pod_name(result.name, node["name"], node["templateName"])


def stdout(result, node: dict) -> str:
    return (pod_dir(result, node) / "stdout.log").read_text()
