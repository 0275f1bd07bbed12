"""Each step's command line, role and image come from one table (pipelines/workflow/commands.py): the Argo
templates and the KFP pipeline both run what it builds, each with its own placeholders."""

from __future__ import annotations

import pytest
import yaml

from pipelines.kfp_pipeline import compile_pipeline
from pipelines.workflow import pytorchjob
from pipelines.workflow.build import workflow
from pipelines.workflow.commands import KFP, STEP_KINDS, pytorchjob_launcher_command, step_command
from steps.run.config import validate_config

BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run", "iterations": 2}


def argo_containers(cfg) -> dict[str, dict]:
    return {t["name"]: t["container"] for t in workflow(cfg).to_dict()["spec"]["templates"] if "container" in t}


def kfp_argv(cfg, tmp_path, display_name: str) -> tuple[str, list[str]]:
    """The image and the command after plan's resume guard (`--`) of the KFP task with that display name."""
    spec, _ = yaml.safe_load_all(compile_pipeline(cfg, tmp_path / "kfp.yaml").read_text())
    for component in [spec["root"], *spec["components"].values()]:
        for task in component.get("dag", {}).get("tasks", {}).values():
            if task["taskInfo"]["name"] == display_name:
                executor = spec["components"][task["componentRef"]["name"]]["executorLabel"]
                container = spec["deploymentSpec"]["executors"][executor]["container"]
                argv = [*container["command"], *container["args"]]
                return container["image"], argv[argv.index("--") + 1 :]
    raise AssertionError(display_name)


@pytest.mark.parametrize("kind", ["rollout", "publish", "update"])
def test_argo_and_kfp_run_the_tables_command_line_image_and_role(kind, tmp_path):
    cfg = validate_config({**BASE, "images": {"cpu": "cpu:1", "rollout": "rollout:1", "trainer": "trainer:1"}})
    step = step_command(cfg, kind)
    container = argo_containers(cfg)[kind]
    assert [*container["command"], *container["args"]] == step.argv
    assert container["image"] == step.image == getattr(cfg.images, STEP_KINDS[kind].image)
    image, argv = kfp_argv(cfg, tmp_path, f"{kind}-slot-1")
    shard = "{{$.inputs.parameters['shard']}}"  # the ParallelFor's item, an input of the component
    assert (image, argv) == (step.image, [a.replace(KFP.shard, shard) for a in step_command(cfg, kind, KFP).argv])
    assert step.role == STEP_KINDS[kind].role and cfg.placement[step.role] is not None


def test_a_multi_node_update_on_kfp_is_the_launcher_pod_of_the_argo_job(tmp_path):
    cfg = validate_config({**BASE, "trainer": {"nodes": 3}})
    with pytest.raises(ValueError, match="multi-node"):
        step_command(cfg, "update")
    launcher = pytorchjob_launcher_command(cfg, pytorchjob.manifest(cfg, KFP.iteration))
    assert kfp_argv(cfg, tmp_path, "update-slot-1") == (cfg.images.cpu, launcher.argv)
    assert launcher.command == ["python", "-m", "steps.pytorchjob_launcher"] and launcher.role == "control"


def test_kfp_rollouts_open_engines_of_their_own_with_rollout_servers_configured():
    """KFP has no daemon tasks: rollout.servers is Argo's, so a KFP rollout shard keeps its engine and its GPU
    pool, and Argo's is a client of its Workflow's servers."""
    from pipelines.workflow.commands import ARGO, KFP, step_command
    from steps.run.config import validate_config

    cfg = validate_config({"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run",
                           "rollout": {"servers": 2}})  # fmt: skip
    kfp, argo = step_command(cfg, "rollout", KFP), step_command(cfg, "rollout", ARGO)
    assert "--workflow" not in kfp.args and (kfp.role, kfp.image) == ("rollout", cfg.images.rollout)
    assert argo.args[-2:] == ["--workflow", "{{workflow.name}}"] and (argo.role, argo.image) == (
        "control",
        cfg.images.cpu,
    )
