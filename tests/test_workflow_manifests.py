"""Every rendered Argo manifest validates against Argo's types (strict: unknown fields fail; from Hera's models
on any clone, and against Argo v4.1.2's own schema.json where tests/argo_reference.py finds it), reads back
through Hera unchanged, and carries what the cluster and the Argo UI need."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml
from argo_strict_schema import errors, official_validator
from hera.workflows import CronWorkflow, Workflow, WorkflowTemplate

from pipelines.config import load_config
from pipelines.render import CRON_WORKFLOW, WORKFLOW, WORKFLOW_FROM_TEMPLATE, WORKFLOW_TEMPLATE, render
from pipelines.workflow import pytorchjob
from steps.run.config import validate_config

REPO = Path(__file__).resolve().parents[1]
ARGO_FILES = (WORKFLOW_TEMPLATE, WORKFLOW, WORKFLOW_FROM_TEMPLATE, CRON_WORKFLOW)
HERA_CLASSES = {"Workflow": Workflow, "WorkflowTemplate": WorkflowTemplate, "CronWorkflow": CronWorkflow}
BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}
VARIANTS = {
    "demo": None,
    "eks-p5en": None,
    "staleness-1-segments": {**BASE, "iterations": 5, "segment_size": 2, "staleness": 1},
    "rollout-servers": {**BASE, "iterations": 3, "segment_size": 2, "rollout": {"num_shards": 3, "servers": 2}},
    "multi-node": {**BASE, "iterations": 2, "trainer": {"nodes": 3},
                   "placement": {"trainer": {"priority_class": "moerl-trainer", "shm_size": "8Gi",
                                             "resources": {"limits": {"nvidia.com/gpu": 8}}}}},
    "multi-node-server": {**BASE, "iterations": 2, "trainer": {"nodes": 3, "server": True},
                          "placement": {"trainer": {"priority_class": "moerl-trainer", "shm_size": "8Gi",
                                                    "resources": {"limits": {"nvidia.com/gpu": 8}}}}},
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    data = VARIANTS[name]
    cfg = load_config(REPO / "configs" / f"{name}.yaml") if data is None else validate_config(data)
    if name == "eks-p5en":  # 400 iterations: the same templates, fewer of them, keep the test quick
        cfg = cfg.model_copy(update={"iterations": 25})
    out = tmp_path_factory.mktemp(name)
    render(cfg, out)
    _parsed[out] = {name: [yaml.load(d, Loader=LOADER) for d in documents(out / name)] for name in ARGO_FILES}
    return name, out


LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_parsed: dict[Path, dict[str, list[dict]]] = {}


def documents(path: Path) -> list[str]:
    return [d for d in re.split(r"^---\n", path.read_text(), flags=re.M) if d.strip()]


def manifests(out: Path) -> dict[str, list[dict]]:
    """The parsed manifests (a fresh copy: tests may change them)."""
    return copy.deepcopy(_parsed[out])


def templates(manifest: dict) -> dict[str, dict]:
    spec = manifest["spec"].get("workflowSpec", manifest["spec"])
    return {t["name"]: t for t in spec.get("templates", [])}


def test_every_manifest_validates_against_the_strict_argo_schema(rendered):
    _, out = rendered
    for name, docs in manifests(out).items():
        for doc in docs:
            assert errors(doc) == [], f"{name}: {doc['kind']} {doc['metadata']}"


def test_every_manifest_validates_against_argos_own_schema(rendered):
    _, out = rendered
    for name, docs in manifests(out).items():
        for doc in docs:
            found = [f"{list(e.absolute_path)}: {e.message}" for e in official_validator(doc["kind"]).iter_errors(doc)]
            assert found == [], f"{name}: {doc['kind']} {doc['metadata']}"


def test_the_strict_schema_catches_a_typo(rendered):
    _, out = rendered
    doc = manifests(out)[WORKFLOW][0]
    doc["spec"]["templates"][1]["retryStrategy"]["limt"] = 3
    assert any("'limt' was unexpected" in e for e in errors(doc))


def test_hera_reads_every_manifest_back_unchanged(rendered):
    _, out = rendered
    for name in ARGO_FILES:
        for text in documents(out / name):
            doc = yaml.load(text, Loader=LOADER)
            assert HERA_CLASSES[doc["kind"]].from_yaml(text).to_dict() == doc, name


def test_workflows_carry_ui_metadata_and_housekeeping(rendered):
    variant, out = rendered
    found = manifests(out)
    for template in found[WORKFLOW_TEMPLATE]:
        meta = template["spec"]["workflowMetadata"]  # what Workflows submitted from the template get
        assert meta["annotations"]["workflows.argoproj.io/title"].startswith("moerl ")
        assert "staleness" in meta["annotations"]["workflows.argoproj.io/description"]
        assert meta["labels"]["moerl.io/run"] == template["metadata"]["name"].split("-seg-")[0]
    for doc in (*found[WORKFLOW_TEMPLATE], *found[WORKFLOW]):
        spec = doc["spec"]
        assert spec["onExit"] == "report" and spec["entrypoint"] == "main"
        assert spec["ttlStrategy"]["secondsAfterSuccess"] > 0 and spec["podGC"]["strategy"]
        assert spec["serviceAccountName"]
        if variant == "demo":
            assert "synchronization" not in spec
        else:
            assert spec["synchronization"]["semaphores"][0]["configMapKeyRef"] == {
                "name": "moerl-semaphores", "key": "runs"}  # fmt: skip
            assert spec["synchronization"]["mutexes"][0]["name"].startswith("moerl-run-")
        for name, template in templates(doc).items():
            if "container" in template:
                labels = template["metadata"]["labels"]
                assert labels["moerl.io/run"] and labels["moerl.io/step"] == name
                if name in ("rollout", "score", "update", "publish"):
                    assert labels["moerl.io/iteration"] == "{{inputs.parameters.iteration}}"


def test_score_reports_prometheus_gauges_per_iteration(rendered):
    _, out = rendered
    score = templates(manifests(out)[WORKFLOW][0])["score"]
    assert score["outputs"]["parameters"] == [
        {"name": "metrics", "valueFrom": {"path": "/tmp/metrics.json", "default": "{}"}}
    ]
    args = score["container"]["args"]
    assert args[args.index("--metrics-out") + 1] == "/tmp/metrics.json"
    gauges = {m["name"]: m for m in score["metrics"]["prometheus"]}
    assert set(gauges) == {"moerl_reward_mean", "moerl_accuracy"}
    reward = gauges["moerl_reward_mean"]
    assert reward["gauge"]["value"] == "{{=jsonpath(outputs.parameters.metrics, '$.reward_mean')}}"
    assert {"key": "iteration", "value": "{{inputs.parameters.iteration}}"} in reward["labels"]
    assert reward["when"] == "{{status}} == Succeeded"


def test_the_report_is_the_exit_handler_and_its_png_an_artifact(rendered):
    variant, out = rendered
    report = templates(manifests(out)[WORKFLOW][0])["report"]
    args = report["container"]["args"]
    assert args[args.index("--status") + 1] == "{{workflow.status}}"
    if variant == "demo":  # no artifact repository on this machine: the PNG goes to <run>/report/
        assert "outputs" not in report
    else:
        assert report["outputs"]["artifacts"] == [
            {"name": "report-png", "path": "/tmp/report/report.png", "archive": {"none": {}}}]  # fmt: skip


def trainer_pod(by_name: dict[str, dict]) -> dict:
    """The pod that holds the trainer's GPUs, as {metadata, spec}: the update's, the trainer server's, or the
    Master replica of the PyTorchJob that the update or the trainer server's launcher creates."""
    server = by_name.get("trainer-server")
    holder = server if server is not None else by_name["update"]
    if server is None and "container" not in holder:
        job = yaml.safe_load(by_name["update-job"]["resource"]["manifest"])
    elif holder["container"]["command"] == ["python", "-m", "steps.pytorchjob_launcher"]:
        args = holder["container"]["args"]
        job = json.loads(args[args.index("--manifest-json") + 1])
    else:
        return {"metadata": holder["metadata"], "spec": {**holder, "containers": [holder["container"]]}}
    return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]


def test_trainer_pods_are_not_disrupted_and_get_shared_memory(rendered):
    variant, out = rendered
    pod = trainer_pod(templates(manifests(out)[WORKFLOW][0]))
    assert pod["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    args = container["args"]
    assert args[args.index("--nproc-per-node") + 1] == ("8" if variant == "eks-p5en" else "2")
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    if variant == "eks-p5en":
        limits = container["resources"]["limits"]
        assert limits["vpc.amazonaws.com/efa"] == "16" and limits["hugepages-2Mi"] == "5120Mi"
        assert pod["spec"]["priorityClassName"] == "moerl-trainer"


def test_a_multi_node_update_is_a_pytorchjob_that_argo_waits_on(rendered):
    variant, out = rendered
    if variant != "multi-node":
        pytest.skip("single-node update, or a multi-node trainer that stays up")
    update = templates(manifests(out)[WORKFLOW][0])["update-job"]
    resource = update["resource"]
    assert resource["action"] == "create" and resource["setOwnerReference"] is True
    assert resource["successCondition"] == pytorchjob.SUCCESS_CONDITION
    assert resource["failureCondition"] == pytorchjob.FAILURE_CONDITION
    job = yaml.safe_load(resource["manifest"])
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    nodes = 3
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == nodes - 1
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["command"] == ["torchrun"]
    assert container["args"][container["args"].index("--nnodes") + 1] == str(nodes)
    assert "{{inputs.parameters.iteration}}" in container["args"]
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1


def test_the_cron_workflow_continues_the_run(rendered):
    variant, out = rendered
    (cron,) = manifests(out)[CRON_WORKFLOW]
    spec = cron["spec"]
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["schedules"] and spec["timezone"] and spec["startingDeadlineSeconds"] > 0
    (ref_workflow,) = manifests(out)[WORKFLOW_FROM_TEMPLATE]
    first_template = manifests(out)[WORKFLOW_TEMPLATE][0]["metadata"]["name"]
    # Both start from the first segment; its plan skips what LATEST already covers.
    assert spec["workflowSpec"]["workflowTemplateRef"] == {"name": first_template}
    assert ref_workflow["spec"] == {"workflowTemplateRef": {"name": first_template}}


def test_no_template_exceeds_the_workflow_object_budget(rendered):
    variant, out = rendered
    for text in documents(out / WORKFLOW_TEMPLATE):
        assert len(text.encode()) < 256 * 1024  # leaves most of etcd's ~1.5 MB for the Workflow's status


def test_the_steps_that_report_progress_say_so_to_argo(rendered):
    """Argo takes the pod annotation as the node's first progress, then reads what the step writes to
    $ARGO_PROGRESS_FILE (steps/progress.py); moerl local --chaos strikes these pods at a progress report."""
    _, out = rendered
    by_name = templates(manifests(out)[WORKFLOW][0])
    reporting = {
        name for name, t in by_name.items()
        if (t.get("metadata") or {}).get("annotations", {}).get("workflows.argoproj.io/progress") == "0/1"
    }  # fmt: skip
    one_pod_update = {"update"} if "container" in by_name["update"] else set()  # a PyTorchJob's pods are not Argo's
    servers = {"rollout-server", "trainer-server"} & by_name.keys()  # requests served: rollout_server, trainer_server
    assert reporting == {"plan", "import-sft", "rollout", "score", "publish"} | one_pod_update | servers


def test_rollout_servers_are_daemons_of_each_segment_and_the_shards_their_clients(rendered):
    name, out = rendered
    if name != "rollout-servers":
        pytest.skip("the variant with rollout.servers")
    segments = [m for m in manifests(out)[WORKFLOW_TEMPLATE] if m["kind"] == "WorkflowTemplate"]
    assert len(segments) == 1  # one template runs both segments (it was one template per segment)
    for segment in segments:
        by_name = templates(segment)
        tasks = {t["name"]: t for t in by_name["main"]["dag"]["tasks"]}
        assert {"rollout-server-0", "rollout-server-1"} <= tasks.keys() and "rollout-server-2" not in tasks
        rollouts = [t for name, t in tasks.items() if name.startswith("rollout-") and "server" not in name]
        for k in (0, 1):  # Argo replaces a lost daemon only while a task below it is unfinished: its dependents
            term = f"(rollout-server-{k} || rollout-server-{k}.Failed || rollout-server-{k}.Errored)"
            assert all(term in t["depends"] for t in rollouts)
        server = by_name["rollout-server"]
        assert server["daemon"] is True
        probe = server["container"]["readinessProbe"]["exec"]["command"]
        assert probe[:3] == ["python", "-m", "steps.server_probe"] and "{{workflow.name}}" in probe
        env = {e["name"]: e for e in server["container"]["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert server["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
        assert '"75"' in server["retryStrategy"]["expression"]
        assert "maxDuration" not in server["retryStrategy"]["backoff"]  # Argo counts it from the segment's start
        client = by_name["rollout"]
        assert client["container"]["args"][-2:] == ["--workflow", "{{workflow.name}}"]
        assert "nodeSelector" not in client  # a client holds no engine: off the GPU Spot pool
        assert client["retryStrategy"]["expression"] == 'lastRetry.status == "Error" || lastRetry.exitCode == "75"'
