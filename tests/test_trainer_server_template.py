"""The trainer that stays up as Argo runs it: its daemon template (placed and sized as the update, an exec
readinessProbe, POD_IP, restarted after a crash; over several nodes, the launcher of its PyTorchJob), its
command lines, and the update step as its client, retried when the trainer is lost (exit 75). The DAG's
daemon tasks are graph.py's (not here)."""

from __future__ import annotations

import json

import pytest
from argo_strict_schema import validator
from hera.workflows import Workflow

from pipelines.workflow import graph, pytorchjob, templates
from pipelines.workflow.commands import step_command
from pipelines.workflow.retry import CLIENT_RETRY_EXPRESSION
from steps.run.config import validate_config
from steps.run.serving import EXIT_SERVER_LOST

BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}


def config(**trainer: object):
    trainer_placement = {"priority_class": "moerl-trainer", "node_selector": {"pool": "gpu"},
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                         "resources": {"requests": {"cpu": "8"}, "limits": {"nvidia.com/gpu": "4"}}}  # fmt: skip
    data = {**BASE, "trainer": {"server": True, "nproc_per_node": 4, **trainer},
            "placement": {"trainer": trainer_placement}}  # fmt: skip
    return validate_config(data, "test config")


def rendered(template) -> dict:
    """The template as it lands in a Workflow, checked against Argo's strict schema."""
    manifest = Workflow(name="wf", entrypoint=template.name, templates=[template]).to_dict()
    errors = sorted(validator("Workflow").iter_errors(manifest), key=str)
    assert not errors, errors[0]
    return manifest["spec"]["templates"][0]


def test_the_trainer_server_is_a_torchrun_of_the_trainers_ranks_serving_its_workflow():
    step = step_command(config(), "trainer-server")
    assert step.role == "trainer" and step.image == config().images.trainer
    assert step.argv == [
        "torchrun", "--nproc-per-node", "4", "--standalone", "--nnodes", "1", "-m", "steps.trainer_server", "--",
        "--run", "file:///tmp/run", "--workflow", "{{workflow.name}}",
    ]  # fmt: skip


def test_the_step_parses_the_command_line_the_template_gives_it(monkeypatch):
    from steps import trainer_server

    seen = {}

    def serve_trainer(run: str, workflow: str, port: int, idle_exit_s: float) -> int:
        seen.update(run=run, workflow=workflow, port=port, idle_exit_s=idle_exit_s)
        return 0

    monkeypatch.setattr(trainer_server, "serve_trainer", serve_trainer)
    argv = step_command(config(), "trainer-server").argv
    monkeypatch.setattr("sys.argv", ["trainer_server", *argv[argv.index("--") :]])
    assert trainer_server.main() == 0
    assert seen == {"run": "file:///tmp/run", "workflow": "{{workflow.name}}", "port": 0, "idle_exit_s": 0.0}
    # The replicas of a multi-node trainer's job: the same step, which also ends itself once idle.
    job = pytorchjob.trainer_server_manifest(config(nodes=2), "wf", "uid")
    args = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["args"]
    monkeypatch.setattr("sys.argv", ["trainer_server", *args[args.index("--") :]])
    assert trainer_server.main() == 0
    assert seen == {"run": "file:///tmp/run", "workflow": "wf", "port": 0, "idle_exit_s": 3600.0}


def test_the_update_is_a_client_of_the_trainer_only_when_trainer_server():
    assert step_command(config(), "update").argv == [
        "python", "-m", "steps.update", "--run", "file:///tmp/run", "--iteration", "{{inputs.parameters.iteration}}",
        "--workflow", "{{workflow.name}}",
    ]  # fmt: skip
    plain = step_command(config(server=False), "update")
    assert plain.command == ["torchrun"] and "--workflow" not in plain.args


def test_the_daemon_is_placed_sized_and_probed_as_a_server():
    cfg = config()
    daemon = rendered(templates.trainer_server_template(cfg))
    plain = rendered(templates.update_template(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(
        update={"server": False})})))  # fmt: skip
    client = rendered(templates.update_template(cfg))
    assert daemon["daemon"] is True
    for field in ("nodeSelector", "affinity", "tolerations", "priorityClassName", "volumes", "securityContext"):
        assert daemon.get(field) == plain.get(field), field  # the GPUs of today's update
    assert daemon["container"]["resources"] == plain["container"]["resources"]
    assert "resources" not in client["container"] and client.get("nodeSelector") != daemon.get("nodeSelector")
    assert daemon["container"]["resources"]["limits"]["nvidia.com/gpu"] in (4, "4")
    probe = daemon["container"]["readinessProbe"]
    assert probe["exec"]["command"] == [
        "python", "-m", "steps.server_probe", "--run", "file:///tmp/run", "--workflow", "{{workflow.name}}",
        "--server", "trainer",
    ]  # fmt: skip
    env = {e["name"]: e for e in daemon["container"]["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # On demand (the trainer always is): restarted after any failure, as a dead rank ends torchrun with exit 1.
    assert daemon["retryStrategy"]["retryPolicy"] == "Always" and "expression" not in daemon["retryStrategy"]
    assert daemon["retryStrategy"]["limit"] == cfg.retries["trainer"].limit


def test_a_client_whose_trainer_was_lost_is_retried_and_no_other_failure():
    exprlang = pytest.importorskip("pipelines.local.lang.exprlang")
    strategy = rendered(templates.update_template(config()))["retryStrategy"]
    assert strategy["expression"] == CLIENT_RETRY_EXPRESSION
    assert strategy["retryPolicy"] == "Always"

    def retried(status: str, code: str) -> bool:
        env = {"lastRetry": {"status": status, "exitCode": code, "message": f"exit code {code}", "duration": "9"}}
        return exprlang.evaluate_bool(strategy["expression"], env)

    assert retried("Failed", str(EXIT_SERVER_LOST)) and retried("Error", "-1")
    assert not retried("Failed", "1") and not retried("Failed", "2")
    # Without trainer.server the update keeps today's strategy: Argo errors only.
    assert rendered(templates.update_template(config(server=False)))["retryStrategy"]["retryPolicy"] == "OnError"


def launched_job(daemon: dict) -> dict:
    args = daemon["container"]["args"]
    return json.loads(args[args.index("--manifest-json") + 1])


def test_over_several_nodes_the_daemon_launches_the_trainers_pytorchjob_and_the_update_is_its_client():
    cfg = config(nodes=3)
    daemon = rendered(templates.trainer_server_template(cfg))
    assert daemon["daemon"] is True
    assert daemon["container"]["command"] == ["python", "-m", "steps.pytorchjob_launcher"]
    args = daemon["container"]["args"]
    assert args[args.index("--deadline-seconds") + 1] == "0"  # the job lives as long as its segment
    assert "resources" not in daemon["container"]  # the launcher holds no GPU; the job's pods do
    assert daemon["container"]["readinessProbe"]["exec"]["command"][-2:] == ["--server", "trainer"]
    assert daemon["retryStrategy"]["retryPolicy"] == "Always" and "expression" not in daemon["retryStrategy"]
    assert daemon["retryStrategy"]["limit"] == cfg.retries["trainer"].limit  # the trainer's budget, not control's

    job = launched_job(daemon)
    assert job["metadata"]["name"] == pytorchjob.trainer_server_job_name(cfg)
    assert job["metadata"]["ownerReferences"] == [{"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                                                   "name": "{{workflow.name}}", "uid": "{{workflow.uid}}"}]  # fmt: skip
    assert job["spec"]["runPolicy"] == {"backoffLimit": 0, "cleanPodPolicy": "Running"}  # no deadline
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    assert {spec["restartPolicy"] for spec in replicas.values()} == {"Never"}  # a failed rank fails the job
    container = replicas["Master"]["template"]["spec"]["containers"][0]
    assert container["args"] == [
        "--nproc-per-node", "4", "--nnodes", "3", "-m", "steps.trainer_server", "--",
        "--run", "file:///tmp/run", "--workflow", "{{workflow.name}}", "--idle-exit-s", "3600.0",
    ]  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # rank 0 registers it
    update = pytorchjob.manifest(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"server": False})}),
                                 "1")  # fmt: skip
    per_iteration_pod = update["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    for field in ("nodeSelector", "affinity", "tolerations", "priorityClassName", "securityContext"):
        assert replicas["Worker"]["template"]["spec"].get(field) == per_iteration_pod.get(field), field
    assert container["resources"] == per_iteration_pod["containers"][0]["resources"]

    client = rendered(templates.update_template(cfg))
    assert client["container"]["command"] == ["python", "-m", "steps.update"]
    assert "--workflow" in client["container"]["args"] and "resources" not in client["container"]
    names = {t.name for t in templates.templates(cfg, graph.segments(cfg.iterations, cfg.segment_size)[0], None)}
    assert templates.UPDATE_JOB not in names and templates.UPDATE_CLEAR not in names
