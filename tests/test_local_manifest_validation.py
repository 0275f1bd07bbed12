"""What `moerl local` refuses before anything runs: fields it cannot run (`unsupported: FIELD at
PATH`), fields that are not Argo's (typos), broken references; and how it resolves references to
WorkflowTemplates. The field tables are kept equal to Argo's JSON schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from argo_reference import reference_path
from argo_strict_schema import strict_schema

from pipelines.local import run_workflow
from pipelines.local.api.fields import SHAPES
from pipelines.local.api.manifest import load_workflow
from steps.errors import MoerlError

ARGO = "io.argoproj.workflow.v1alpha1."
CORE = "io.k8s.api.core.v1."
SCHEMA_DEFINITIONS = {
    "Workflow": ARGO + "Workflow", "CronWorkflow": ARGO + "CronWorkflow", "CronWorkflowSpec": ARGO + "CronWorkflowSpec",
    "WorkflowTemplate": ARGO + "WorkflowTemplate", "ClusterWorkflowTemplate": ARGO + "ClusterWorkflowTemplate",
    "ObjectMeta": "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta", "WorkflowSpec": ARGO + "WorkflowSpec",
    "WorkflowTemplateRef": ARGO + "WorkflowTemplateRef", "TemplateRef": ARGO + "TemplateRef",
    "Template": ARGO + "Template", "WorkflowStep": ARGO + "WorkflowStep", "DAGTask": ARGO + "DAGTask",
    "DAGTemplate": ARGO + "DAGTemplate", "LifecycleHook": ARGO + "LifecycleHook", "Sequence": ARGO + "Sequence",
    "ContinueOn": ARGO + "ContinueOn", "RetryStrategy": ARGO + "RetryStrategy", "Backoff": ARGO + "Backoff",
    "Arguments": ARGO + "Arguments", "Inputs": ARGO + "Inputs", "Outputs": ARGO + "Outputs",
    "Parameter": ARGO + "Parameter", "ValueFrom": ARGO + "ValueFrom", "Container": CORE + "Container",
    "Script": ARGO + "ScriptTemplate", "EnvVar": CORE + "EnvVar", "EnvVarSource": CORE + "EnvVarSource",
    "VolumeMount": CORE + "VolumeMount", "Volume": CORE + "Volume",
    "PersistentVolumeClaim": CORE + "PersistentVolumeClaim", "ResourceTemplate": ARGO + "ResourceTemplate",
    "SuspendTemplate": ARGO + "SuspendTemplate", "Synchronization": ARGO + "Synchronization",
    "Mutex": ARGO + "Mutex", "SemaphoreRef": ARGO + "SemaphoreRef", "Memoize": ARGO + "Memoize",
    "Cache": ARGO + "Cache",
}  # fmt: skip


def test_every_field_table_lists_exactly_the_fields_of_argos_schema():
    """Equal to Argo v4.1.2's own schema (where the reference folder is there)."""
    definitions = json.loads(reference_path("schema.json").read_text())["definitions"]
    assert set(SHAPES) == set(SCHEMA_DEFINITIONS)
    for shape, definition in SCHEMA_DEFINITIONS.items():
        assert set(SHAPES[shape]) == set(definitions[definition]["properties"]), shape


def test_every_field_of_argos_types_in_heras_models_is_in_a_field_table():
    """On a bare clone: every field of Argo's types as Hera's models have them (Argo v4.0.5, which v4.1.2
    extends) is one the executor knows, so no Argo field is ever reported as unknown."""
    definitions = strict_schema()["definitions"]
    assert set(SHAPES) == set(SCHEMA_DEFINITIONS)
    for shape, definition in SCHEMA_DEFINITIONS.items():
        assert set(SHAPES[shape]) >= set(definitions[definition]["properties"]), shape


def hello(**template_fields) -> dict:
    template = {"name": "main", "container": {"image": "busybox", "command": ["echo", "hi"]}, **template_fields}
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": "t"},
        "spec": {"entrypoint": "main", "templates": [template]},
    }


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (
            hello(sidecars=[{"name": "s", "image": "x"}]),
            "unsupported: sidecars at spec.templates[0] ('main'): the local executor runs one process per step",
        ),
        (
            hello(outputs={"artifacts": [{"name": "a", "path": "/tmp/a"}]}),
            "unsupported: artifacts at spec.templates[0].outputs",
        ),
        (
            hello(retryStrategy={"limt": 3}),
            "unknown field: limt at spec.templates[0].retryStrategy (not a field of Argo's RetryStrategy; a typo?)",
        ),
        (
            hello(container={"image": "x", "command": ["true"], "envFrom": [{"secretRef": {"name": "s"}}]}),
            "unsupported: envFrom at spec.templates[0].container",
        ),
        (
            hello(volumes=[{"name": "v", "secret": {"secretName": "s"}}]),
            "unsupported: secret at spec.templates[0].volumes[0]",
        ),
    ],
)
def test_fields_that_cannot_run_here_stop_the_run_before_it_starts(manifest, message):
    with pytest.raises(MoerlError) as err:
        load_workflow(manifest)
    assert str(err.value).startswith(message)


def test_scheduling_fields_are_accepted_and_recorded(tmp_path: Path):
    manifest = hello(
        nodeSelector={"karpenter.sh/capacity-type": "spot"},
        tolerations=[{"key": "spot", "operator": "Exists"}],
        metrics={"prometheus": []},
        synchronization={"mutexes": [{"name": "m"}]},
        metadata={"labels": {"a": "b"}},
    )
    manifest["spec"].update(podGC={"strategy": "OnPodSuccess"}, ttlStrategy={"secondsAfterCompletion": 10})
    result = run_workflow(manifest, workdir=tmp_path, view=None)
    assert result.succeeded
    pod = json.loads(next((result.run_dir / "pods").glob("*/pod.json")).read_text())
    assert pod["spec"]["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    assert pod["spec"]["containers"][0]["image"] == "busybox"
    assert pod["local"]["spotPlaced"] is True


def steps_manifest(steps: list, templates: list | None = None, **spec) -> dict:
    echo = {
        "name": "echo",
        "inputs": {"parameters": [{"name": "m"}]},
        "container": {"image": "x", "command": ["echo", "{{inputs.parameters.m}}"]},
    }
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "t-"},
        "spec": {
            "entrypoint": "main",
            "templates": [{"name": "main", "steps": steps}, echo] + (templates or []),
            **spec,
        },
    }


def echo_step(name: str, value: str, **fields) -> dict:
    return {"name": name, "template": "echo", "arguments": {"parameters": [{"name": "m", "value": value}]}, **fields}


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (steps_manifest([[{"name": "a", "template": "nope"}]]), "template name 'nope' undefined"),
        (steps_manifest([[{"name": "a", "template": "echo"}]]), "inputs.parameters.m was not supplied"),
        (
            steps_manifest([[echo_step("a", "1", hooks={"running": {"template": "echo", "expression": "true"}})]]),
            "unsupported: hooks.running",
        ),
        (steps_manifest([[echo_step("a", "1", when="{{=nosuchfn(1)}}")]]), "unsupported: nosuchfn()"),
        (
            steps_manifest([], [{"name": "d", "dag": {"tasks": [{"name": "x", "template": "d", "depends": "y"}]}}]),
            "templates.d.tasks.x dependency 'y' not defined",
        ),
        (
            steps_manifest(
                [],
                [
                    {
                        "name": "d",
                        "dag": {
                            "tasks": [
                                {"name": "x", "template": "d", "depends": "y"},
                                {"name": "y", "template": "d", "depends": "x"},
                            ]
                        },
                    }
                ],
            ),
            "dependency cycle",
        ),
        (steps_manifest([], activeDeadlineSeconds="soon"), "spec.activeDeadlineSeconds must be a non-negative integer"),
        (
            steps_manifest([], [{"name": "s", "steps": [], "activeDeadlineSeconds": 5}]),
            "templates.s.activeDeadlineSeconds is only valid for leaf templates",
        ),
        (
            steps_manifest([], [{"name": "r", "resource": {"action": "create", "manifest": "kind: Job"}}]),
            "unsupported: resource kind 'Job'",
        ),
        (steps_manifest([], [{"name": "z", "suspend": {}}]), "unsupported: suspend without duration"),
    ],
)
def test_broken_references_are_reported_before_anything_runs(manifest, message):
    with pytest.raises(MoerlError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        load_workflow(manifest)


def test_unknown_parameters_on_the_command_line_are_refused():
    with pytest.raises(MoerlError, match="-p mesage: the workflow declares no parameter 'mesage'"):
        load_workflow(
            steps_manifest([], arguments={"parameters": [{"name": "message", "value": "x"}]}), {"mesage": "y"}
        )


def test_a_workflow_argument_without_value_needs_p():
    with pytest.raises(MoerlError, match="spec.arguments.message.value is required; pass -p message=VALUE"):
        load_workflow(steps_manifest([], arguments={"parameters": [{"name": "message"}]}))


def test_a_workflow_template_ref_resolves_from_a_sibling_file(tmp_path: Path):
    template = steps_manifest(
        [[echo_step("a", "{{workflow.parameters.who}}")]],
        arguments={"parameters": [{"name": "who", "value": "template"}]},
    )
    template.update(kind="WorkflowTemplate", metadata={"name": "greeter"})
    (tmp_path / "greeter.yaml").write_text(yaml.safe_dump(template))
    workflow = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "g-"},
        "spec": {
            "workflowTemplateRef": {"name": "greeter"},
            "arguments": {"parameters": [{"name": "who", "value": "workflow"}]},
        },
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(workflow))
    result = run_workflow(tmp_path / "run.yaml", parameters={"who": "cli"}, workdir=tmp_path / "w", view=None)
    assert result.succeeded
    pods = [n for n in result.status["nodes"].values() if n["type"] == "Pod"]
    assert [p["inputs"]["parameters"][0]["value"] for p in pods] == ["cli"]


def test_a_template_ref_runs_the_named_template_of_another_workflow_template(tmp_path: Path):
    say = {
        "name": "say",
        "inputs": {"parameters": [{"name": "m"}]},
        "steps": [[echo_step("inner", "{{inputs.parameters.m}}")]],
    }
    echo = {
        "name": "echo",
        "inputs": {"parameters": [{"name": "m"}]},
        "container": {"image": "x", "command": ["echo", "lib:{{inputs.parameters.m}}"]},
    }
    library = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "WorkflowTemplate",
        "metadata": {"name": "lib"},
        "spec": {"templates": [say, echo]},
    }
    workflow = steps_manifest(
        [
            [
                {
                    "name": "a",
                    "templateRef": {"name": "lib", "template": "say"},
                    "arguments": {"parameters": [{"name": "m", "value": "hi"}]},
                }
            ]
        ]
    )
    (tmp_path / "lib.yaml").write_text(yaml.safe_dump(library))
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(workflow))
    result = run_workflow(tmp_path / "wf.yaml", workdir=tmp_path / "w", view=None)
    assert result.succeeded
    stdout = [p.read_text() for p in (result.run_dir / "pods").glob("*/stdout.log")]
    assert stdout == ["lib:hi\n"]


def test_a_missing_template_ref_names_where_it_was_looked_for(tmp_path: Path):
    workflow = steps_manifest([[{"name": "a", "templateRef": {"name": "nowhere", "template": "say"}}]])
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(workflow))
    with pytest.raises(MoerlError, match="template reference nowhere.say not found; put the WorkflowTemplate's"):
        load_workflow(tmp_path / "wf.yaml")


def test_a_workflow_template_submitted_directly_runs_as_a_workflow(tmp_path: Path):
    template = hello()
    template.update(kind="WorkflowTemplate", metadata={"name": "hello-tmpl"})
    result = run_workflow(template, workdir=tmp_path, view=None)
    assert result.succeeded and result.name.startswith("hello-tmpl-") and len(result.name) == len("hello-tmpl-") + 5


def test_not_a_workflow_is_refused(tmp_path: Path):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(MoerlError, match="no Argo workflow in it \\(kinds found: ConfigMap\\)"):
        load_workflow(tmp_path / "cm.yaml")
