"""The KFP pipeline: compiled IR with the run's DAG (staleness included), placement from kfp-kubernetes, every
iteration step behind the resume guard, caching off, and the report as the exit task."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipelines.config import load_config
from pipelines.kfp_pipeline import compile_pipeline, seconds
from pipelines.workflow import graph
from steps.pytorchjob_launcher import job_outcome
from steps.run.config import validate_config

REPO = Path(__file__).resolve().parents[1]
BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}


def compiled(cfg, tmp_path) -> tuple[dict, dict]:
    path = compile_pipeline(cfg, tmp_path / "kfp.yaml")
    spec, platform = yaml.safe_load_all(path.read_text())
    return spec, platform


def tasks_by_display_name(spec: dict) -> dict[str, dict]:
    """Every task of the IR (nested DAGs included) by its display name."""
    found = {}
    for component in [spec["root"], *spec["components"].values()]:
        for task in component.get("dag", {}).get("tasks", {}).values():
            found[task["taskInfo"]["name"]] = task
    return found


def executor_args(spec: dict, task: dict) -> list[str]:
    component = spec["components"][task["componentRef"]["name"]]
    return spec["deploymentSpec"]["executors"][component["executorLabel"]]["container"]["args"]


# KFP runs no daemons: with rollout.servers and trainer.server set (Argo's), its steps open engines and trainers of
# their own and read published versions, so rollout and update wait for publish as without them.
SERVED = {"rollout": {"servers": 2}, "trainer": {"server": True}}


@pytest.mark.parametrize("served", [{}, SERVED], ids=["plain", "servers-set"])
@pytest.mark.parametrize("staleness", [0, 1])
def test_the_pipeline_has_the_runs_dag(tmp_path, staleness, served):
    cfg = validate_config({**BASE, "iterations": 3, "staleness": staleness, **served})
    spec, _ = compiled(cfg, tmp_path)
    tasks = tasks_by_display_name(spec)
    # A task's dependencies name tasks by their IR keys; map those to display names.
    keys = {}
    for component in [spec["root"], *spec["components"].values()]:
        for key, task in component.get("dag", {}).get("tasks", {}).items():
            keys.setdefault(key, task["taskInfo"]["name"])
    for name, parents in graph.dependencies(graph.whole_run(3), staleness).items():
        step, _, slot = name.rpartition("-")
        display = f"{step}-slot-{slot}" if step in graph.STEPS else name
        if step == "rollout":  # the ParallelFor group carries the dependencies of the fan-out
            display = name
        wanted = {f"{p.rpartition('-')[0]}-slot-{p.rpartition('-')[2]}" if p.rpartition("-")[0] in graph.STEPS
                  else p for p in parents}  # fmt: skip
        wanted = {w.replace("rollout-slot-", "rollout-") for w in wanted}
        if step in graph.STEPS:  # every slot also reads its iteration from plan's output
            wanted.add("plan")
        got = {keys[k] for k in tasks[display].get("dependentTasks", [])}
        assert got == wanted, name
    loop = tasks["rollout-2"]
    assert loop["parameterIterator"]["items"]["raw"] == "[0, 1]"


def test_iteration_steps_run_behind_the_resume_guard_without_cache(tmp_path):
    cfg = validate_config({**BASE, "iterations": 30, "segment_size": 4})
    spec, _ = compiled(cfg, tmp_path)
    tasks = tasks_by_display_name(spec)
    assert {f"update-slot-{j}" for j in range(1, 5)} <= set(tasks) and "update-slot-5" not in tasks
    args = executor_args(spec, tasks["update-slot-3"])
    assert args[: args.index("--")] == [
        "-m", "steps.plan", "--run", "file:///tmp/run", "--first-iteration", "{{$.inputs.parameters['first']}}",
        "--slot", "2", "--iterations", "30", "--staleness", "0"]  # fmt: skip
    assert args[args.index("--") + 1 :][:1] == ["torchrun"] and "{iteration}" in args
    assert tasks["update-slot-3"]["inputs"]["parameters"]["first"]["taskOutputParameter"] == {
        "outputParameterKey": "next", "producerTask": "plan"}  # fmt: skip
    for name, task in tasks.items():
        if "componentRef" in task and not name.startswith("run"):
            assert task.get("cachingOptions", {}).get("enableCache") is not True, name
    import_args = executor_args(spec, tasks["import-sft"])
    assert import_args[import_args.index("--unless-published") + 1] == "0"


def test_the_report_is_the_exit_task(tmp_path):
    spec, _ = compiled(validate_config({**BASE, "iterations": 2}), tmp_path)
    tasks = tasks_by_display_name(spec)
    assert tasks["report"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"


def test_eks_placement_and_retries_come_through(tmp_path):
    cfg = load_config(REPO / "configs" / "eks-p5en.yaml").model_copy(update={"segment_size": 2})
    spec, platform = compiled(cfg, tmp_path)
    tasks = tasks_by_display_name(spec)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    rollout_component = spec["components"][tasks["rollout-slot-1"]["componentRef"]["name"]]
    rollout = executors[rollout_component["executorLabel"]]
    assert rollout["nodeSelector"]["labels"]["karpenter.sh/capacity-type"] == "spot"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in rollout["tolerations"]
    assert rollout["emptyDirMounts"][0]["mountPath"] == "/dev/shm"
    container = spec["deploymentSpec"]["executors"][rollout_component["executorLabel"]]["container"]
    assert container["resources"]["accelerator"]["resourceCount"] == "8"
    retry = tasks["rollout-slot-1"]["retryPolicy"]
    assert retry["maxRetryCount"] == 10 and retry["backoffDuration"] == "30s"
    # 16 nodes: the update slot is a launcher that creates the PyTorchJob and waits for it.
    update_args = executor_args(spec, tasks["update-slot-1"])
    assert update_args[update_args.index("--") + 1 : update_args.index("--") + 4] == [
        "python", "-m", "steps.pytorchjob_launcher"]  # fmt: skip
    manifest = update_args[update_args.index("--manifest-json") + 1]
    assert '"kind": "PyTorchJob"' in manifest and '"replicas": 15' in manifest


def test_kfp_durations_are_seconds():
    assert [seconds(d) for d in ("2s", "5m", "1h", "30", "1.5m")] == ["2s", "300s", "3600s", "30s", "90s"]


def test_pytorchjob_outcome_follows_the_replica_statuses_and_conditions():
    assert job_outcome({"status": {}}) is None
    assert job_outcome({"status": {"replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 3}}}}) is None
    assert job_outcome({"status": {"replicaStatuses": {"Master": {"succeeded": 1}}}}) == "Succeeded"
    # a Worker pod lost to its node: the operator recreates it, the job goes on
    assert job_outcome({"status": {"replicaStatuses": {"Worker": {"failed": 1}}}}) is None
    failed = {"status": {"conditions": [{"type": "Created", "status": "True"}, {"type": "Failed", "status": "True"}]}}
    assert job_outcome(failed) == "Failed"


def test_every_kfp_step_runs_as_the_images_non_root_user(tmp_path):
    _, platform = compiled(validate_config(BASE), tmp_path)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert executors
    for name, executor in executors.items():
        context = executor.get("securityContext") or {}
        assert context.get("runAsNonRoot") is True, name
        assert str(context.get("runAsUser")) == str(context.get("runAsGroup")) == "10001", name
