"""The CronWorkflow and the segments that next-segment hands on to: every segment created while the run's
cron exists is the cron's child, so Argo's `concurrencyPolicy: Forbid` sees it. Argo v4.1.2's cron
controller counts as active every unfinished Workflow that carries the cron label and whose controller
ownerReference is the CronWorkflow (workflow/cron/controller.go wfInformerListOptionsFunc, groupWorkflows;
operator.go reconcileActiveWfs), and Forbid skips a firing while that list is not empty."""

from __future__ import annotations

import yaml

from pipelines.workflow.build import cron_workflow, workflow_templates
from pipelines.workflow.templates import CRON_LABEL, NEXT_SEGMENT_ALONE, NEXT_SEGMENT_CRON, NEXT_SEGMENT_OWNED
from steps.run.config import validate_config

BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run", "iterations": 10, "segment_size": 4}
CRON_UID = "1b2c3d4e-0000-4000-8000-000000000001"


def templates_of() -> dict[str, dict]:
    """The templates of the run's one WorkflowTemplate, which every segment runs."""
    cfg = validate_config(BASE)
    (template,) = workflow_templates(cfg)
    return {t["name"]: t for t in template.to_dict()["spec"]["templates"]}


def created_workflow(template: dict, cron_uid: str) -> dict:
    """The Workflow that the resource template creates, with the step's inputs substituted."""
    text = template["resource"]["manifest"].replace("{{inputs.parameters.cron-uid}}", cron_uid)
    body = yaml.safe_load(text)
    body["metadata"]["uid"] = "segment-2-uid"
    return body


def active_for_forbid(cron: dict, workflows: list[dict]) -> list[str]:
    """What Argo's cron controller lists in status.active for `cron` (phases other than Succeeded, Failed and
    Error are unfinished)."""
    active = []
    for wf in workflows:
        if CRON_LABEL not in wf["metadata"].get("labels", {}):
            continue  # not in the cron controller's informer at all
        owner = next((o for o in wf["metadata"].get("ownerReferences", []) if o.get("controller")), None)
        if owner is None or owner["kind"] != "CronWorkflow" or owner["uid"] != cron["metadata"]["uid"]:
            continue
        if wf.get("status", {}).get("phase") not in ("Succeeded", "Failed", "Error"):
            active.append(wf["metadata"]["uid"])
    return active


def test_a_segment_handed_on_under_the_cron_keeps_the_cron_from_firing():
    cfg = validate_config(BASE)
    cron = cron_workflow(cfg).to_dict()
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    cron["metadata"]["uid"] = CRON_UID
    tpl = templates_of()
    lookup = tpl[NEXT_SEGMENT_CRON]["resource"]
    assert lookup["action"] == "get" and "--ignore-not-found" in lookup["flags"]
    assert yaml.safe_load(lookup["manifest"])["metadata"]["name"] == cron["metadata"]["name"]
    assert tpl[NEXT_SEGMENT_CRON]["outputs"]["parameters"][0]["valueFrom"] == {"jsonPath": "{.metadata.uid}",
                                                                                "default": ""}  # fmt: skip
    segment_2 = created_workflow(tpl[NEXT_SEGMENT_OWNED], CRON_UID)
    segment_2["status"] = {"phase": "Pending"}  # queued on the run's mutex
    assert active_for_forbid(cron, [segment_2]) == ["segment-2-uid"]  # the next firing is skipped
    segment_2["status"] = {"phase": "Succeeded"}
    assert active_for_forbid(cron, [segment_2]) == []
    owner = segment_2["metadata"]["ownerReferences"][0]
    assert owner["blockOwnerDeletion"] is False  # no finalizer rights needed on the cron


def test_which_create_runs_depends_on_the_cron_lookup():
    steps = templates_of()["next-segment"]["steps"]
    assert [s["template"] for s in steps[0]] == [NEXT_SEGMENT_CRON]
    when = {s["template"]: s["when"] for s in steps[1]}
    found = "'{{steps.cron.outputs.parameters.cron-uid}}'"
    assert when == {NEXT_SEGMENT_OWNED: f"{found} != ''", NEXT_SEGMENT_ALONE: f"{found} == ''"}
    alone = yaml.safe_load(templates_of()[NEXT_SEGMENT_ALONE]["resource"]["manifest"])
    assert "ownerReferences" not in alone["metadata"] and CRON_LABEL not in alone["metadata"]["labels"]
    # The next segment runs the same template (it was the next segment's own, demo-seg-002 after demo-seg-001),
    # from the iteration after this segment's last.
    owned = yaml.safe_load(templates_of()[NEXT_SEGMENT_OWNED]["resource"]["manifest"])
    assert owned["spec"]["workflowTemplateRef"] == {"name": "demo"}
    assert owned["spec"]["arguments"]["parameters"] == [
        {"name": "first", "value": "{{=asInt(workflow.parameters.first) + 4}}"}]  # fmt: skip
