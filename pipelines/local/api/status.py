"""Workflow and node status in the shape of Argo's `status` (pkg/apis/workflow/v1alpha1 NodeStatus).

Node names and IDs follow Argo: the root node is named after the workflow; steps are `wf[0].step`,
DAG tasks `wf.task`, retry attempts `<node>(0)`, loop items `<node>(0:item)`, exit handlers
`wf.onExit`; a node's ID is the workflow name plus the FNV-32a hash of its name, the root's ID is
the workflow name. Timestamps are written with second precision (RFC 3339, UTC), as Kubernetes
stores them, and durations that Argo exposes (lastRetry.duration) are taken from those.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Node types and phases, as Argo spells them.
POD, STEPS, STEP_GROUP, DAG, TASK_GROUP, RETRY, SKIPPED, SUSPEND = (
    "Pod",
    "Steps",
    "StepGroup",
    "DAG",
    "TaskGroup",
    "Retry",
    "Skipped",
    "Suspend",
)
PENDING, RUNNING, SUCCEEDED, FAILED, ERROR, OMITTED = (
    "Pending",
    "Running",
    "Succeeded",
    "Failed",
    "Error",
    "Omitted",
)
SKIPPED_PHASE = "Skipped"
ACTIVE_TYPES = (POD, STEPS, DAG)  # the nodes Argo's getActiveChildren counts (node_counters.go)
ACTIVE_PHASES = (PENDING, RUNNING)


@functools.lru_cache(maxsize=1 << 16)  # every pass looks its nodes up by name again: hash each name once
def fnv32a(text: str) -> int:
    value = 0x811C9DC5
    for byte in text.encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def node_id(workflow_name: str, node_name: str) -> str:
    return workflow_name if node_name == workflow_name else f"{workflow_name}-{fnv32a(node_name)}"


def pod_name(workflow_name: str, node_name: str, template_name: str) -> str:
    """Argo's pod names (version v2): <workflow>-<template>-<hash of node name>."""
    if node_name == workflow_name:
        return workflow_name
    prefix = f"{workflow_name}-{template_name}" if template_name else workflow_name
    return f"{prefix[:242]}-{fnv32a(node_name)}"


def timestamp(seconds: float | None) -> str | None:
    """metav1.Time: RFC 3339 in UTC with second precision, null when unset."""
    if seconds is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(seconds)))


def status_timestamp(seconds: float | None) -> str | None:
    """A node's or the workflow's startedAt/finishedAt in the status file: RFC 3339 in UTC to the millisecond.
    Argo stamps whole seconds; a local step often lasts under one, and `moerl simulate --measured` fits step
    times from these stamps, so the fraction is kept (metav1.Time and every RFC 3339 reader accept it). Template
    variables ({{steps.X.startedAt}}) keep Argo's whole seconds (timestamp)."""
    if seconds is None:
        return None
    whole = int(seconds)
    millis = min(999, int(round((seconds - whole) * 1000)))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def fulfilled(phase: str) -> bool:
    return phase in (SUCCEEDED, FAILED, ERROR, SKIPPED_PHASE, OMITTED)


def completed(phase: str) -> bool:
    return phase in (SUCCEEDED, FAILED, ERROR)


def failed_or_error(phase: str) -> bool:
    return phase in (FAILED, ERROR)


@dataclass
class Node:
    id: str
    name: str
    display_name: str
    type: str
    template_name: str
    phase: str
    boundary_id: str
    started_at: float
    finished_at: float | None = None
    message: str = ""
    children: list[str] = field(default_factory=list)
    outbound_nodes: list[str] = field(default_factory=list)
    inputs: dict | None = None
    outputs: dict | None = None
    hooked: bool = False  # an exit handler's node (Argo's nodeFlag.hooked)
    retried: bool = False  # an attempt under a Retry node (Argo's nodeFlag.retried)
    reported_progress: tuple[int, int] | None = None  # what a pod wrote to its ARGO_PROGRESS_FILE ("N/M")
    memoization: dict | None = None  # Argo's memoizationStatus: hit, key, cacheName
    daemoned: bool = False  # a daemon's pod, running and ready: fulfilled for the steps and tasks after it
    # Not part of Argo's status: the node the terminal view nests this one under.
    display_parent: str | None = None

    @property
    def fulfilled(self) -> bool:
        """Argo's NodeStatus.Fulfilled: done, skipped or omitted, or daemoned (and not Pending)."""
        return fulfilled(self.phase) or (self.daemoned and self.phase != PENDING)

    @property
    def completed(self) -> bool:
        return completed(self.phase)

    @property
    def failed_or_error(self) -> bool:
        return failed_or_error(self.phase)

    def duration(self, now: float | None = None) -> float:
        """Seconds between the stored (whole-second) timestamps, as Argo's GetDuration sees them."""
        end = self.finished_at if self.finished_at is not None else (now or time.time())
        return float(int(end) - int(self.started_at))

    def to_argo(self, workflow_name: str, progress: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "name": self.name,
            "displayName": self.display_name,
            "type": self.type,
            "templateName": self.template_name,
            "templateScope": f"local/{workflow_name}",
            "phase": self.phase,
            "boundaryID": self.boundary_id,
            "message": self.message,
            "startedAt": status_timestamp(self.started_at),
            "finishedAt": status_timestamp(self.finished_at),
            "progress": progress,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "children": self.children,
            "outboundNodes": self.outbound_nodes,
            "memoizationStatus": self.memoization,
            "daemoned": self.daemoned or None,
        }
        if self.hooked or self.retried:
            out["nodeFlag"] = {k: True for k, v in (("hooked", self.hooked), ("retried", self.retried)) if v}
        # Go's omitempty: drop empty strings, lists and absent objects (the timestamps stay, as null).
        return {k: v for k, v in out.items() if v not in ("", [], None) or k in ("startedAt", "finishedAt")}


class Nodes:
    """All nodes of one workflow, by ID, in creation order."""

    def __init__(self, workflow_name: str):
        self.workflow_name = workflow_name
        self.by_id: dict[str, Node] = {}
        # Indexes kept by create/mark/add_child, so that a pass over N nodes costs O(N), not O(N^2) (a loop of
        # thousands of items asks for its boundary's active children, and adds each child, on every pass):
        self._active: dict[str, set[str]] = {}  # boundary ID -> its Pod/Steps/DAG nodes that are Pending/Running
        self._active_pods: set[str] = set()  # Pod nodes that are Pending or Running
        self._child_ids: dict[str, set[str]] = {}  # node ID -> its children, as a set

    def __iter__(self):  # noqa: ANN204
        return iter(self.by_id.values())

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, node_id_: str) -> Node | None:
        return self.by_id.get(node_id_)

    def by_name(self, name: str) -> Node | None:
        return self.by_id.get(node_id(self.workflow_name, name))

    def create(
        self,
        name: str,
        type_: str,
        template_name: str,
        boundary_id: str,
        phase: str,
        *,
        message: str = "",
        display_parent: str | None = None,
        hooked: bool = False,
        now: float | None = None,
    ) -> Node:
        """Argo's initializeNode: a new node, its display name relative to its boundary."""
        now = time.time() if now is None else now
        id_ = node_id(self.workflow_name, name)
        if id_ in self.by_id:
            raise RuntimeError(f"node {name} already initialized")
        boundary = self.by_id.get(boundary_id)
        display_name = name
        if boundary is not None:
            display_name = name.removeprefix(boundary.name)
            if display_name.startswith("."):
                display_name = display_name[1:]
            elif display_name.startswith("[") and "]." in display_name:
                head, _, rest = display_name.partition("].")
                display_name = rest if head[1:].isdigit() else display_name
        node = Node(
            id=id_,
            name=name,
            display_name=display_name,
            type=type_,
            template_name=template_name,
            phase=phase,
            boundary_id=boundary_id,
            started_at=now,
            message=message,
            display_parent=display_parent,
            hooked=hooked,
        )
        if fulfilled(phase):
            node.finished_at = now
        self.by_id[id_] = node
        self._index_activity(node)
        return node

    def add_child(self, parent_name: str, child_name: str) -> None:
        parent = self.by_name(parent_name)
        if parent is None:
            return
        child = node_id(self.workflow_name, child_name)
        known = self._child_ids.get(parent.id)
        if known is None or len(known) != len(parent.children):  # (rebuilt if children were added elsewhere)
            known = self._child_ids[parent.id] = set(parent.children)
        if child not in known:
            parent.children.append(child)
            known.add(child)

    def active_children(self, boundary_id: str) -> int:
        """Argo's getActiveChildren: the Pod, Steps and DAG nodes of a boundary that are Pending or Running."""
        return len(self._active.get(boundary_id, ()))

    def active_pods(self) -> int:
        """The Pod nodes that are Pending or Running."""
        return len(self._active_pods)

    def _index_activity(self, node: Node) -> None:
        if node.type not in ACTIVE_TYPES:
            return
        if node.phase in ACTIVE_PHASES:
            self._active.setdefault(node.boundary_id, set()).add(node.id)
            if node.type == POD:
                self._active_pods.add(node.id)
        else:
            self._active.get(node.boundary_id, set()).discard(node.id)
            self._active_pods.discard(node.id)

    def mark(self, node: Node, phase: str, message: str | None = None) -> Node:
        """Argo's markNodePhase: set phase (and message), stamp finishedAt the first time it is done."""
        node.phase = phase
        self._index_activity(node)
        if message is not None:
            node.message = message
        if fulfilled(node.phase) and node.finished_at is None:
            node.finished_at = time.time()
        return node

    def pods(self) -> list[Node]:
        return [n for n in self if n.type == POD]

    def progress(self) -> dict[str | None, str]:
        """Argo's progress "N/M" (workflow/progress/updater.go): a pod or suspend node is 0/1, or what its
        pod reported in ARGO_PROGRESS_FILE, and complete (M/M) once Succeeded, Skipped or Omitted (a Failed
        pod stays 0/1); the workflow (key None) and every other node sum the pods nested under them in the
        tree the view draws."""
        done: dict[str | None, int] = {None: 0}
        total: dict[str | None, int] = {None: 0}
        for node in self:
            done.setdefault(node.id, 0)
            total.setdefault(node.id, 0)
            if node.type not in (POD, SUSPEND):
                continue
            node_done, node_total = node.reported_progress or (0, 1)
            if node.phase in (SUCCEEDED, SKIPPED_PHASE, OMITTED):
                node_done = node_total
            ancestor: str | None = node.id
            while True:
                total[ancestor] = total.get(ancestor, 0) + node_total
                done[ancestor] = done.get(ancestor, 0) + node_done
                if ancestor is None:
                    break
                parent = self.by_id.get(ancestor)
                ancestor = parent.display_parent if parent is not None else None
        return {key: f"{done[key]}/{total[key]}" for key in total}

    def failures(self) -> list[dict[str, Any]]:
        """{{workflow.failures}}: every Failed or Errored node, as Argo's failedNodeStatus."""
        return [
            {
                "displayName": n.display_name,
                "message": n.message,
                "templateName": n.template_name,
                "phase": n.phase,
                "podName": pod_name(self.workflow_name, n.name, n.template_name),
                "finishedAt": timestamp(n.finished_at),
            }
            for n in self
            if n.failed_or_error
        ]


@dataclass
class WorkflowStatus:
    phase: str = PENDING
    started_at: float | None = None
    finished_at: float | None = None
    message: str = ""
    outputs: dict | None = None

    def to_argo(self, nodes: Nodes) -> dict[str, Any]:
        progress = nodes.progress()
        out: dict[str, Any] = {
            "phase": self.phase,
            "startedAt": status_timestamp(self.started_at),
            "finishedAt": status_timestamp(self.finished_at),
            "progress": progress[None],
            "nodes": {n.id: n.to_argo(nodes.workflow_name, progress[n.id]) for n in nodes},
        }
        if self.message:
            out["message"] = self.message
        if self.outputs:
            out["outputs"] = self.outputs
        if completed(self.phase):
            out["conditions"] = [{"type": "PodRunning", "status": "False"}, {"type": "Completed", "status": "True"}]
        return out


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
