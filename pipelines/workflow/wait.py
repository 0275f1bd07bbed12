"""`moerl submit --wait`: follow a run's Workflow and every segment it hands on to, until the run ends.

A Workflow queued on the run's mutex or the semaphore is `Pending` (and has no phase at all right after it
was created), so waiting only while it is `Running` (Hera's Workflow.wait) returns at once. This waits until
the phase is final (Succeeded, Failed, Error); a Succeeded segment that is not the run's last has created the
next one (its next-segment step, labelled with its parent's name), which is followed the same way. The run
ends with the first segment that does not succeed, or with the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pipelines.workflow import placement as pl

FINAL_PHASES = ("Succeeded", "Failed", "Error")
PARENT_LABEL = "moerl.io/parent"  # on a segment's Workflow: the name of the Workflow that created it


def phase_of(workflow: Any) -> str | None:
    status = getattr(workflow, "status", None)
    return getattr(status, "phase", None) if status is not None else None


def wait_for_run(
    service: Any,
    namespace: str,
    name: str,
    poll_seconds: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
) -> str:
    """The final phase of the run that Workflow `name` starts (its last segment's, or the first failed one's)."""
    while True:
        workflow = service.get_workflow(name, namespace=namespace)
        phase = phase_of(workflow)
        if phase not in FINAL_PHASES:
            sleep(poll_seconds)
            continue
        labels = workflow.metadata.labels or {}
        log(f"Workflow {name} (segment {int(labels.get(pl.SEGMENT_LABEL, 0)) + 1}) ended {phase}")
        if phase != "Succeeded":
            return phase
        successors = service.list_workflows(namespace=namespace, label_selector=f"{PARENT_LABEL}={name}").items
        if not successors:
            return phase  # the run's last segment
        name = sorted(successors, key=lambda w: str(w.metadata.creation_timestamp))[0].metadata.name
