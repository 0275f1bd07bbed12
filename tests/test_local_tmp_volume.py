"""A pod's /tmp emptyDir, run by the local executor: what the pod itself creates there (its declared output
paths, HOME=/tmp) lives in a directory of that pod, while host paths under /tmp given to it (a file:// run
store, a test's tmp_path, a workflow argument) stay the host's. The rendered moerl workflow mounts such a
volume in every step (its root filesystem is read-only), and its run stores often live under /tmp."""

from __future__ import annotations

import json

import pytest
import yaml
from argo_helpers import pod_dir, workflow

from pipelines.local import run_workflow
from pipelines.local.pods.sandbox import Sandbox

TMP_VOLUME = [{"name": "tmp", "emptyDir": {}}]
TMP_MOUNT = [{"name": "tmp", "mountPath": "/tmp"}]


@pytest.fixture(autouse=True)
def fast_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")


def test_a_tmp_volume_holds_the_pods_own_files_and_leaves_host_paths_under_tmp(tmp_path):
    assert str(tmp_path).startswith("/tmp/")  # the case that matters: the host's files are under /tmp too
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    script = (
        "mkdir -p /tmp/plan && echo -n {{inputs.parameters.v}} > /tmp/plan/latest; "
        'echo -n "$HOME" > /tmp/home; '
        "echo {{inputs.parameters.v}} >> {{workflow.parameters.dir}}/from-argument.txt; "
        "echo {{workflow.parameters.store}} > " + str(host_dir) + "/store-{{inputs.parameters.v}}.txt"
    )
    writer = {
        "name": "writer",
        "inputs": {"parameters": [{"name": "v"}]},
        "outputs": {
            "parameters": [
                {"name": "latest", "valueFrom": {"path": "/tmp/plan/latest"}},
                {"name": "home", "valueFrom": {"path": "/tmp/home"}},
            ]
        },
        "volumes": TMP_VOLUME,
        "container": {
            "image": "alpine",
            "command": ["sh", "-c", script],
            "env": [{"name": "HOME", "value": "/tmp"}],
            "volumeMounts": TMP_MOUNT,
        },
    }
    main = {
        "name": "main",
        "steps": [[{"name": "w", "template": "writer", "withItems": ["a", "b"],
                    "arguments": {"parameters": [{"name": "v", "value": "{{item}}"}]}}]],
    }  # fmt: skip
    store = (tmp_path / "run").as_uri()
    arguments = {"parameters": [{"name": "dir", "value": str(host_dir)}, {"name": "store", "value": store}]}
    result = run_workflow(workflow([main, writer], arguments=arguments), workdir=tmp_path / "work", view=None)

    assert result.succeeded
    nodes = {n["displayName"]: n for n in result.status["nodes"].values()}
    for i, value in enumerate("ab"):
        node = nodes[f"w({i}:{value})"]
        volume = pod_dir(result, node) / "volumes" / "tmp"
        outputs = {p["name"]: p["value"] for p in node["outputs"]["parameters"]}
        assert outputs == {"latest": value, "home": str(volume)}  # each pod its own /tmp, HOME in it
        assert (volume / "plan" / "latest").read_text() == value
        assert (host_dir / f"store-{value}.txt").read_text() == store + "\n"  # the URI untouched
    assert sorted((host_dir / "from-argument.txt").read_text().split()) == ["a", "b"]  # the host's file


def test_a_pytorchjob_mounts_the_volumes_of_its_pod(tmp_path):
    """The volumes of a PyTorchJob's pods are in its manifest, not in the Argo template that creates it."""
    done = tmp_path / "done.txt"
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"generateName": "train-"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "volumes": TMP_VOLUME,
                            "containers": [
                                {
                                    "name": "pytorch",
                                    "image": "trainer",
                                    "command": ["python", "-c", f"open({str(done)!r}, 'w').write('ok')"],
                                    "env": [{"name": "HOME", "value": "/tmp"}],
                                    "volumeMounts": TMP_MOUNT,
                                }
                            ],
                        }
                    },
                }
            }
        },
    }
    train = {
        "name": "main",
        "resource": {
            "action": "create",
            "manifest": yaml.safe_dump(job),
            "successCondition": "status.replicaStatuses.Master.succeeded > 0",
            "failureCondition": "status.replicaStatuses.Master.failed > 0",
        },
    }
    result = run_workflow(workflow([train]), workdir=tmp_path / "work", view=None)
    assert result.succeeded, result.status
    assert done.read_text() == "ok"
    node = next(n for n in result.status["nodes"].values() if n["type"] == "Pod")
    recorded = json.loads((pod_dir(result, node) / "pod.json").read_text())
    assert recorded["local"]["env"]["HOME"] == str(pod_dir(result, node) / "volumes" / "tmp")


def test_a_shared_directory_mount_maps_only_itself_and_the_declared_paths(tmp_path):
    root, volume = tmp_path / "root", tmp_path / "vol"
    box = Sandbox(root, {"/tmp": volume, "/scratch": tmp_path / "scratch"}, ["/tmp/plan/latest", "/tmp/m.json"])
    text = (
        "--out /tmp/plan --latest /tmp/plan/latest --m /tmp/m.json --home /tmp --s /scratch/x "
        "--run /tmp/runs/demo --store file:///tmp/plan --other /tmp/m.json2 /tmp/planner"
    )
    assert box.rewrite(text).split() == [
        "--out", f"{volume}/plan",
        "--latest", f"{volume}/plan/latest",
        "--m", f"{volume}/m.json",
        "--home", str(volume),
        "--s", f"{tmp_path}/scratch/x",  # a mount on a directory the host does not share: all of it
        "--run", "/tmp/runs/demo",
        "--store", "file:///tmp/plan",
        "--other", "/tmp/m.json2",
        "/tmp/planner",
    ]  # fmt: skip
    assert box.host_path("/tmp/plan/latest") == volume / "plan" / "latest"
