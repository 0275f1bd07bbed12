"""One reader of an Argo Workflow's status: its nodes, each as the step and iteration it belongs to.

The local executor writes its status in Argo's shape, so this reads both: the report step's trackers
(steps/tracking/trackers.py), `moerl demo`'s step wall times, `moerl simulate`'s measured step times and the learning
bench. Each of them picks the nodes it counts; how a node's name, iteration, attempt and times are spelled
is read here only.

A task's node is named `<step>-<iteration>` (`score-3`), its attempts `<task>(N)`, a fanned-out task's
items `<task>(I:ITEM)` with their own attempts (`rollout-3(0:1)(2)`); plan, import-sft and report carry no
iteration.
"""

from __future__ import annotations

import base64
import gzip
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

_DISPLAY = re.compile(r"^(?P<step>[a-z-]+)-(?P<iteration>\d+)(?P<rest>(\([^)]*\))*)$")


def status_nodes(status: dict[str, Any]) -> dict[str, Any]:
    """The nodes of a Workflow status (or of a whole Workflow object, `argo get -o json`). The controller
    stores a large node map gzipped and base64-encoded in `compressedNodes` (argo util/file
    CompressEncodeString, gzip by default); an offloaded one (`offloadNodeStatusVersion`, in Argo's database)
    or another algorithm cannot be read here: no nodes."""
    if isinstance(status.get("status"), dict):
        status = status["status"]
    if status.get("nodes"):
        return status["nodes"]
    packed = status.get("compressedNodes")
    if packed:
        try:
            return json.loads(gzip.decompress(base64.b64decode(packed)))
        except (ValueError, OSError, EOFError):  # zstd or brotli (ARGO_COMPRESSION_ALGORITHM), or damaged
            return {}
    return {}


def _stamp(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


@dataclass(frozen=True)
class StepNode:
    """One node of the status, read."""

    name: str  # the node's full name (`<workflow>.<task>...`)
    display_name: str
    type: str  # Pod, Retry, TaskGroup, DAG, Steps, ...
    phase: str
    template: str  # templateName: the step kind of a pod
    step: str | None  # from the display name `<step>-<iteration>...`; None for plan, import-sft, report, ...
    iteration: int | None
    attempt: str  # what follows the iteration: "" for the task's own node, "(0:1)(2)" for an item's attempt
    started: datetime | None
    finished: datetime | None


def _iteration(node: dict[str, Any], match: re.Match | None) -> int | None:
    """The iteration a step's node works on: its `iteration` input where it has one (a segment's tasks are named
    by their position in the segment, `rollout-3`, and take the iteration as a parameter; Argo records the
    inputs on every Pod and Retry node), else the number in its display name (a whole run's workflow.yaml)."""
    if match is None:
        return None
    for parameter in (node.get("inputs") or {}).get("parameters") or []:
        if parameter.get("name") == "iteration" and str(parameter.get("value", "")).isdigit():
            return int(parameter["value"])
    return int(match["iteration"])


def step_nodes(status: dict[str, Any]) -> list[StepNode]:
    """Every node of the status, in the status's order."""
    out = []
    for node in status_nodes(status).values():
        display = node.get("displayName") or ""
        match = _DISPLAY.match(display)
        out.append(
            StepNode(
                name=node.get("name") or "",
                display_name=display,
                type=node.get("type") or "",
                phase=node.get("phase") or "",
                template=node.get("templateName") or "",
                step=match["step"] if match else None,
                iteration=_iteration(node, match),
                attempt=match["rest"] if match else "",
                started=_stamp(node.get("startedAt")),
                finished=_stamp(node.get("finishedAt")),
            )
        )
    return out
