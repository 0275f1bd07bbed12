"""Staleness 0 and 1 give the intended dependency graphs, in the pure graph and in the rendered DAG."""

from __future__ import annotations

import pytest
import yaml

from pipelines.workflow import graph, workflow, workflow_templates
from steps.run.config import validate_config
from steps.run.keys import behaviour_version

BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}


def dag_of(manifest: dict) -> dict[str, dict]:
    main = next(t for t in manifest["spec"]["templates"] if t["name"] == manifest["spec"]["entrypoint"])
    return {task["name"]: task for task in main["dag"]["tasks"]}


def depends(task: dict) -> set[str]:
    return set(task["depends"].split(" && ")) if task.get("depends") else set()


def test_staleness_0_is_a_chain_of_iterations():
    deps = graph.dependencies(graph.whole_run(3), staleness=0)
    assert deps == {
        "plan": [],
        "import-sft": ["plan"],
        "rollout-1": ["import-sft"], "score-1": ["rollout-1"], "update-1": ["score-1"], "publish-1": ["update-1"],
        "rollout-2": ["publish-1"], "score-2": ["rollout-2"], "update-2": ["score-2"], "publish-2": ["update-2"],
        "rollout-3": ["publish-2"], "score-3": ["rollout-3"], "update-3": ["score-3"], "publish-3": ["update-3"],
    }  # fmt: skip
    # Nothing of iteration i+1 can run before iteration i is published.
    for i in (1, 2):
        assert f"publish-{i}" in graph.ancestors(f"rollout-{i + 1}", deps)


def test_staleness_1_overlaps_the_next_rollout_with_the_update():
    deps = graph.dependencies(graph.whole_run(4), staleness=1)
    assert deps["rollout-1"] == ["import-sft"] and deps["rollout-2"] == ["import-sft"]
    assert deps["rollout-3"] == ["publish-1"] and deps["rollout-4"] == ["publish-2"]
    assert deps["update-3"] == ["score-3", "publish-2"]  # trains from v2, so waits for it
    for i in (1, 2, 3):
        # rollout-(i+1) and update-i wait for neither: they run at the same time.
        assert f"update-{i}" not in graph.ancestors(f"rollout-{i + 1}", deps)
        assert f"rollout-{i + 1}" not in graph.ancestors(f"update-{i}", deps)
        # ...but at most one version behind: rollout-(i+1) still waits for publish-(i-1).
        if i >= 2:
            assert f"publish-{i - 1}" in graph.ancestors(f"rollout-{i + 1}", deps)


@pytest.mark.parametrize("staleness", [0, 1])
def test_with_indexed_versions_rollout_waits_for_the_update_and_publish_runs_beside_it(staleness):
    """Rollout servers with deltas take v(i) once update-i indexed it: rollout waits for the update that made
    its version, publish of that version runs beside the rollout, and the next update still waits for it."""
    deps = graph.dependencies(graph.whole_run(4), staleness, indexed_versions=True)
    for i in range(1, 5):
        source = behaviour_version(i, staleness)
        assert deps[f"rollout-{i}"] == ([f"update-{source}"] if source >= 1 else ["import-sft"])
        assert deps[f"publish-{i}"] == [f"update-{i}"]
        if i >= 2:
            assert f"publish-{i - 1}" in deps[f"update-{i}"]  # trains from the published v(i-1)
        if source >= 1:
            assert f"publish-{source}" not in graph.ancestors(f"rollout-{i}", deps)
            assert f"rollout-{i}" not in graph.ancestors(f"publish-{source}", deps)
    cfg = validate_config({**BASE, "iterations": 4, "staleness": staleness, "rollout": {"servers": 2}})
    tasks = dag_of(workflow(cfg).to_dict())
    steps = lambda task: {d for d in depends(task) if not d.startswith("(rollout-server")}  # noqa: E731 - not servers
    assert {name: steps(tasks[name]) for name in deps} == {k: set(v) for k, v in deps.items()}
    unindexed = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"deltas": False})})
    assert steps(dag_of(workflow(unindexed).to_dict())["rollout-4"]) == {f"publish-{behaviour_version(4, staleness)}"}


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_trainer_that_holds_its_versions_does_not_wait_for_publish(staleness):
    """With the trainer that stays up, update-i trains from the v(i-1) it holds: it waits for update-(i-1), and
    publishes follow one another beside the trainer's path."""
    deps = graph.dependencies(graph.whole_run(4), staleness, indexed_versions=True, trainer_holds_versions=True)
    for i in range(2, 5):
        assert f"update-{i - 1}" in graph.ancestors(f"update-{i}", deps)
        assert deps[f"publish-{i}"] == [f"update-{i}", f"publish-{i - 1}"]
        assert f"publish-{i - 1}" not in graph.ancestors(f"update-{i}", deps)  # it may still be publishing
        if i >= 3:  # publishing at most one version behind the trainer
            assert f"publish-{i - 2}" in graph.ancestors(f"update-{i}", deps)
    if staleness == 1:
        assert deps["update-3"] == ["score-3", "update-2", "publish-1"]
    cfg = validate_config({**BASE, "iterations": 4, "staleness": staleness, "rollout": {"servers": 2},
                           "trainer": {"server": True}})  # fmt: skip
    assert graph.run_dependencies(graph.whole_run(4), cfg, servers_run=True) == deps
    tasks = dag_of(workflow(cfg).to_dict())
    steps = lambda task: {d for d in depends(task) if not d.startswith("(")}  # noqa: E731 - not the servers
    assert {name: steps(tasks[name]) for name in deps} == {k: set(v) for k, v in deps.items()}


@pytest.mark.parametrize(("staleness", "expected"), [(0, [0, 1, 2, 3]), (1, [0, 0, 1, 2])])
def test_rollouts_sample_from_the_policy_the_staleness_allows(staleness, expected):
    assert [behaviour_version(i, staleness) for i in (1, 2, 3, 4)] == expected


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_rendered_dag_is_the_graph(staleness):
    cfg = validate_config({**BASE, "iterations": 4, "staleness": staleness})
    tasks = dag_of(workflow(cfg).to_dict())
    expected = graph.dependencies(graph.whole_run(4), staleness)
    assert {name: depends(task) for name, task in tasks.items()} == {k: set(v) for k, v in expected.items()}
    for i in range(1, 5):
        rollout = tasks[f"rollout-{i}"]
        assert rollout["withSequence"] == {"count": "2"}
        params = {p["name"]: p["value"] for p in rollout["arguments"]["parameters"]}
        assert params == {"iteration": str(i), "shard": "{{item}}",
                          "policy-version": str(behaviour_version(i, staleness))}  # fmt: skip
        for step in graph.STEPS:  # tasks of published iterations are skipped: that is how a run resumes
            assert tasks[f"{step}-{i}"]["when"] == f"{{{{tasks.plan.outputs.parameters.latest}}}} < {i}"
    assert tasks["import-sft"]["when"] == "{{tasks.plan.outputs.parameters.latest}} < 0"


def test_long_runs_split_into_segments_that_hand_on():
    assert [(s.first, s.last) for s in graph.segments(10, 4)] == [(1, 4), (5, 8), (9, 10)]
    cfg = validate_config({**BASE, "iterations": 10, "segment_size": 4, "staleness": 1})
    # One WorkflowTemplate, the run's name, runs every segment (it was one per segment, demo-seg-000..002): its
    # tasks are the segment's positions, its first iteration the parameter `first`.
    (template,) = [t.to_dict() for t in workflow_templates(cfg)]
    assert template["metadata"]["name"] == "demo"
    assert [(p["name"], p["value"]) for p in template["spec"]["arguments"]["parameters"]] == [("first", "1")]
    tasks = dag_of(template)
    assert set(tasks) >= {"import-sft", "rollout-1", "publish-4"} and "rollout-5" not in tasks
    # Positions whose sources lie before the segment start from the plan (through import-sft, which every segment
    # but the run's first skips: that segment is done).
    assert depends(tasks["rollout-1"]) == {"import-sft"} and depends(tasks["rollout-2"]) == {"import-sft"}
    assert depends(tasks["rollout-3"]) == {"publish-1"}
    assert tasks["rollout-3"]["arguments"]["parameters"][0] == {
        "name": "iteration", "value": "{{=asInt(workflow.parameters.first) + 2}}"}  # fmt: skip
    # Every segment but the last submits the next one once its last iteration is published.
    assert depends(tasks["next-segment"]) == {"publish-4"}
    assert tasks["next-segment"]["when"] == "{{workflow.parameters.first}} + 3 < 10"
    for name in ("next-segment-owned", "next-segment-alone"):
        next_template = next(t for t in template["spec"]["templates"] if t["name"] == name)
        body = yaml.safe_load(next_template["resource"]["manifest"])
        assert body["spec"] == {"workflowTemplateRef": {"name": "demo"}, "arguments": {"parameters": [
            {"name": "first", "value": "{{=asInt(workflow.parameters.first) + 4}}"}]}}  # fmt: skip
    plan = next(t for t in template["spec"]["templates"] if t["name"] == "plan")
    args = plan["container"]["args"]
    assert args[args.index("--first") + 1] == "{{workflow.parameters.first}}"
    assert args[args.index("--last") + 1] == "{{=min(asInt(workflow.parameters.first) + 3, 10)}}"
