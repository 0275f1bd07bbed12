"""`moerl submit --wait` follows the run: through Pending (queued on the run's mutex or the semaphore, or no
phase yet just after creation) and through every segment that the first one hands on to."""

from __future__ import annotations

from types import SimpleNamespace

import yaml

from pipelines.workflow.build import workflow_templates
from pipelines.workflow.templates import NEXT_SEGMENT_ALONE, NEXT_SEGMENT_OWNED
from pipelines.workflow.wait import PARENT_LABEL, wait_for_run
from steps.run.config import validate_config


def wf(name: str, phase: str | None, segment: int, created: str = "2026-01-01T00:00:00Z"):
    status = None if phase is None else SimpleNamespace(phase=phase)
    labels = {"moerl.io/segment": str(segment)}
    return SimpleNamespace(metadata=SimpleNamespace(name=name, labels=labels, creation_timestamp=created),
                           status=status)  # fmt: skip


class FakeService:
    """Phases handed out per Workflow in turn (the last one repeats); children by parent name."""

    def __init__(self, phases: dict[str, list[str | None]], children: dict[str, list[str]]) -> None:
        self.phases, self.children, self.polls = phases, children, []

    def get_workflow(self, name: str, namespace: str | None = None):
        self.polls.append(name)
        queue = self.phases[name]
        phase = queue.pop(0) if len(queue) > 1 else queue[0]
        return wf(name, phase, int(name.rsplit("-", 1)[1]))

    def list_workflows(self, namespace: str | None = None, label_selector: str | None = None):
        key, _, parent = label_selector.partition("=")
        assert key == PARENT_LABEL
        return SimpleNamespace(items=[wf(c, None, 0) for c in self.children.get(parent, [])])


def test_wait_covers_pending_and_every_segment():
    service = FakeService(
        {"run-0": [None, "Pending", "Pending", "Running", "Succeeded"], "run-1": ["Pending", "Running", "Succeeded"],
         "run-2": ["Running", "Succeeded"]},
        {"run-0": ["run-1"], "run-1": ["run-2"]},
    )  # fmt: skip
    lines: list[str] = []
    assert wait_for_run(service, "moerl", "run-0", sleep=lambda s: None, log=lines.append) == "Succeeded"
    assert lines == ["Workflow run-0 (segment 1) ended Succeeded", "Workflow run-1 (segment 2) ended Succeeded",
                     "Workflow run-2 (segment 3) ended Succeeded"]  # fmt: skip
    assert service.polls.count("run-0") == 5  # it did not return while Pending


def test_wait_ends_with_the_first_segment_that_fails():
    service = FakeService({"run-0": ["Succeeded"], "run-1": ["Pending", "Failed"]}, {"run-0": ["run-1"]})
    assert wait_for_run(service, "moerl", "run-0", sleep=lambda s: None, log=lambda line: None) == "Failed"


def test_every_next_segment_names_its_parent():
    cfg = validate_config({"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run", "iterations": 10,
                           "segment_size": 4})  # fmt: skip
    templates = {t["name"]: t for t in workflow_templates(cfg)[0].to_dict()["spec"]["templates"]}
    for name in (NEXT_SEGMENT_OWNED, NEXT_SEGMENT_ALONE):
        labels = yaml.safe_load(templates[name]["resource"]["manifest"])["metadata"]["labels"]
        assert labels[PARENT_LABEL] == "{{workflow.name}}"
