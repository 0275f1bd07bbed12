"""One segment WorkflowTemplate for any run length: its tasks are the positions of a segment, its first
iteration the parameter `first`; a last segment shorter than segment_size skips the positions past the run's
end. The template runs under the local executor as Argo runs it, each step replaced by a stub that records
its call (as in test_workflow_local_run.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from argo_strict_schema import errors, official_validator

from pipelines.config import load_config
from pipelines.render import WORKFLOW_TEMPLATE, render
from pipelines.workflow import graph, workflow_templates
from pipelines.workflow.templates import FIRST, NEXT_SEGMENT_CRON, NEXT_SEGMENT_OWNED
from steps.run.config import validate_config

REPO = Path(__file__).resolve().parents[1]
EKS = REPO / "configs" / "eks-p5en.yaml"


def eks(iterations: int):
    return load_config(EKS).model_copy(update={"iterations": iterations})


def dag_tasks(template: dict) -> dict[str, dict]:
    main = next(t for t in template["spec"]["templates"] if t["name"] == template["spec"]["entrypoint"])
    return {task["name"]: task for task in main["dag"]["tasks"]}


def test_any_run_length_renders_the_same_small_set_of_templates():
    size = load_config(EKS).segment_size
    rendered = {n: [t.to_dict() for t in workflow_templates(eks(n))] for n in (1, size, size + 1, 400)}
    for n, docs in rendered.items():
        assert [d["metadata"]["name"] for d in docs] == [eks(n).name], n
        (doc,) = docs
        assert [p["name"] for p in doc["spec"]["arguments"]["parameters"]] == [FIRST]
        assert errors(doc) == [], n
        found = [f"{list(e.absolute_path)}: {e.message}" for e in official_validator(doc["kind"]).iter_errors(doc)]
        assert found == [], n
        positions = {t for t in dag_tasks(doc) if t.startswith("publish-")}
        assert positions == {f"publish-{i}" for i in range(1, min(n, size) + 1)}, n
    # Past one segment the template no longer changes with the run's length, but for the numbers in it.
    longer, longest = (dag_tasks(rendered[n][0]) for n in (size + 1, 400))
    assert longer.keys() == longest.keys() and "next-segment" in longest
    one, other = (yaml.safe_dump(rendered[n][0], width=1 << 20).splitlines() for n in (size + 1, 400))
    assert len(one) == len(other)
    counts = {str(size + 1): "400", ": 2 segments": ": 20 segments", "}}/2,": "}}/20,"}  # iterations, segments

    def scaled(line: str) -> str:
        for short, long in counts.items():
            line = line.replace(short, long)
        return line

    assert all(scaled(a) == b for a, b in zip(one, other, strict=True) if a != b)
    sizes = {n: len(yaml.safe_dump(docs[0]).encode()) for n, docs in rendered.items()}
    assert sizes[400] < sizes[size + 1] * 1.01
    assert sizes[400] < 256 * 1024


def test_the_reference_run_renders_at_most_three_workflow_templates(tmp_path):
    path = render(load_config(EKS), tmp_path, kfp=False)[WORKFLOW_TEMPLATE]
    kinds = [d["kind"] for d in yaml.safe_load_all(path.read_text())]
    assert kinds == ["WorkflowTemplate"]  # 400 iterations: it was 20 WorkflowTemplates, 2.4 MB
    assert path.stat().st_size < 256 * 1024


# ------------------------------------------------------------------------- the template under the local executor


def stubbed_template(tmp_path: Path, latest: int, staleness: int = 0) -> dict:
    """The segment template of a 5-iteration run in segments of 2, each container a stub that appends its
    template name and args to calls.jsonl (plan reports `latest`); next-segment a stub that records the first
    iteration and segment label of the Workflow it would create (the executor creates no Workflows)."""
    cfg = validate_config({
        "sft_checkpoint": "file:///tmp/sft", "run_store": (tmp_path / "run").as_uri(), "iterations": 5,
        "segment_size": 2, "staleness": staleness,
        "argo": {"semaphore": None, "run_mutex": False, "report_artifact": False},
    })  # fmt: skip
    (template,) = workflow_templates(cfg)
    manifest = template.to_dict()
    calls = tmp_path / "calls.jsonl"
    record = (f"import json, os, sys; args = sys.argv[1:]; "
              f"open({str(calls)!r}, 'a').write(json.dumps([NAME, args]) + '\\n')")  # fmt: skip
    templates = []
    for t in manifest["spec"]["templates"]:
        if t["name"] in (NEXT_SEGMENT_CRON, NEXT_SEGMENT_OWNED, "next-segment-alone"):
            continue
        if t["name"] == graph.NEXT_SEGMENT:
            owned = yaml.safe_load(next(x for x in manifest["spec"]["templates"] if x["name"] == NEXT_SEGMENT_OWNED)
                                   ["resource"]["manifest"])  # fmt: skip
            first = owned["spec"]["arguments"]["parameters"][0]["value"]
            label = owned["metadata"]["labels"]["moerl.io/segment"]
            code = record.replace("NAME", repr(t["name"]))
            t = {"name": t["name"], "container": {"image": "stub", "command": [sys.executable, "-c"],
                                                    "args": [code, first, label]}}  # fmt: skip
        elif "container" in t:
            container = t["container"]
            code = record.replace("NAME", repr(t["name"]))
            if t["name"] == "plan":
                code += f"; os.makedirs(args[0], exist_ok=True); open(args[0] + '/latest', 'w').write('{latest}')"
                container["args"] = ["/tmp/plan", *[a for a in container["args"] if not a.startswith('{"')]]
            else:
                container["args"] = [a for a in container["args"] if not a.startswith('{"')]  # not the config JSON
            container["command"] = [sys.executable, "-c", code]
        templates.append(t)
    manifest["spec"]["templates"] = templates
    return manifest


def run_segment(tmp_path: Path, first: int, latest: int, staleness: int = 0) -> tuple[object, list]:
    local = pytest.importorskip("pipelines.local")
    manifest = stubbed_template(tmp_path, latest, staleness)
    result = local.run_workflow(manifest, parameters={FIRST: str(first)}, view=None, workdir=tmp_path / "work")
    calls = [tuple(json.loads(line)) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    return result, calls


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def iterations_of(calls: list, step: str) -> list[str]:
    return sorted({flag(args, "--iteration") for name, args in calls if name == step})


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_shortened_last_segment_runs_only_its_iterations(tmp_path, staleness):
    result, calls = run_segment(tmp_path, first=5, latest=4, staleness=staleness)
    assert result.phase == "Succeeded"  # the positions past the run's end are Skipped, which fails nothing
    names = [name for name, _ in calls]
    plan = next(args for name, args in calls if name == "plan")
    assert (flag(plan, "--first"), flag(plan, "--last")) == ("5", "5")
    for step in graph.STEPS:
        assert iterations_of(calls, step) == ["5"], step
    rollouts = [args for name, args in calls if name == "rollout"]
    assert {flag(a, "--policy-version") for a in rollouts} == {str(4 - staleness)}
    assert len(rollouts) == 2  # the shards of iteration 5 only
    assert "import-sft" not in names and graph.NEXT_SEGMENT not in names  # the run's last segment
    assert names[-1] == "report"
    assert result.metadata["labels"]["moerl.io/segment"] == "2"


def test_a_middle_segment_runs_its_iterations_and_hands_on(tmp_path):
    result, calls = run_segment(tmp_path, first=3, latest=2)
    assert result.phase == "Succeeded"
    for step in graph.STEPS:
        assert iterations_of(calls, step) == ["3", "4"], step
    (handed,) = [args for name, args in calls if name == graph.NEXT_SEGMENT]
    assert handed[-2:] == ["5", "2"]  # the next Workflow: first=5, segment label 2 (0-based: the third)
    assert result.metadata["labels"]["moerl.io/segment"] == "1"


def test_a_segment_resumed_midway_skips_what_latest_covers(tmp_path):
    result, calls = run_segment(tmp_path, first=3, latest=3)
    assert result.phase == "Succeeded"
    for step in graph.STEPS:
        assert iterations_of(calls, step) == ["4"], step
    assert [args[-2:] for name, args in calls if name == graph.NEXT_SEGMENT] == [["5", "2"]]


def test_the_first_segment_imports_the_sft_checkpoint(tmp_path):
    result, calls = run_segment(tmp_path, first=1, latest=-1)
    assert result.phase == "Succeeded"
    names = [name for name, _ in calls]
    assert names.index("import-sft") < names.index("rollout")
    for step in graph.STEPS:
        assert iterations_of(calls, step) == ["1", "2"], step
    assert [args[-2:] for name, args in calls if name == graph.NEXT_SEGMENT] == [["3", "1"]]
    assert result.metadata["labels"]["moerl.io/segment"] == "0"
