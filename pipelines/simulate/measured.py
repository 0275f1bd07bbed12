"""Measured step times: a real run's Argo status (or `moerl local --status-out`'s) reduced to the median
seconds per step kind and to its iteration times, read with the one status reader
(steps/tracking/workflow_status.py)."""

from __future__ import annotations

import difflib
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

from pipelines.simulate.sizing import CLIENT_KINDS, ENGINE_STARTUP, ROLLOUT_CLIENT, STEP_KINDS, UPDATE_CLIENT
from pipelines.workflow import graph
from steps.errors import MoerlError
from steps.tracking.workflow_status import StepNode, step_nodes


def _nodes(status: dict[str, Any]) -> list[StepNode]:
    """The nodes of an Argo status, of a whole Workflow object (`argo get -o json`), or of `moerl local`."""
    inner = status["status"] if isinstance(status.get("status"), dict) else status
    if not isinstance(inner.get("nodes"), dict) and not inner.get("compressedNodes"):
        raise MoerlError("the status has no 'nodes'; pass the file `moerl local --status-out FILE` wrote")
    return step_nodes(status)


def pod_attempts(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Every Succeeded pod: step kind, iteration (None for plan, import-sft, report), start and end seconds.

    A preempted or failed attempt is no measure of a step's duration and is left out."""
    out = []
    for node in _nodes(status):
        if node.type != "Pod" or node.phase != "Succeeded" or node.finished is None or node.started is None:
            continue
        out.append(
            {
                "step": node.template,
                "iteration": node.iteration if node.step in graph.STEPS else None,
                "start": node.started.timestamp(),
                "end": node.finished.timestamp(),
            }
        )
    return sorted(out, key=lambda p: (p["start"], p["end"]))


def step_times_from_status(status_json: dict[str, Any] | str | Path) -> dict[str, float]:
    """Median seconds per step kind (plan, import-sft, rollout per shard, score, update, publish, report) of
    the Succeeded pods in a `moerl local --status-out` status (or an Argo Workflow's status); in a run with
    rollout servers or a trainer server, the rollout and update pods are keyed as clients (rollout-client,
    update-client).

    Argo stamps pods with whole seconds, so from a cluster's status a step shorter than a few seconds is
    measured to about a second (the local executor stamps milliseconds); the median keeps one slow or retried
    outlier from steering the figure."""
    status = _read_json(status_json) if isinstance(status_json, str | Path) else status_json
    templates = {node.template for node in _nodes(status)}
    # With servers, a rollout or update pod is a client: its time is the server's work (sizing.CLIENT_KINDS).
    client_of = {"rollout": ROLLOUT_CLIENT if graph.ROLLOUT_SERVER in templates else "rollout",
                 "update": UPDATE_CLIENT if graph.TRAINER_SERVER in templates else "update"}  # fmt: skip
    durations: dict[str, list[float]] = {}
    for pod in pod_attempts(status):
        if pod["step"] in STEP_KINDS:
            kind = client_of.get(pod["step"], pod["step"])
            durations.setdefault(kind, []).append(pod["end"] - pod["start"])
    if not durations:
        raise MoerlError("the status holds no Succeeded pod of a moerl step; run the workflow to the end first")
    return {kind: statistics.median(values) for kind, values in durations.items()}


def iteration_times_from_status(status_json: dict[str, Any] | str | Path) -> list[float]:
    """Seconds between successive publications; the first from the end of import-sft (or plan, if the run
    resumed). The same definition as SimResult.iteration_times."""
    status = _read_json(status_json) if isinstance(status_json, str | Path) else status_json
    pods = pod_attempts(status)
    starts = [p["end"] for p in pods if p["step"] == "import-sft"] or [p["end"] for p in pods if p["step"] == "plan"]
    published = sorted(p["end"] for p in pods if p["step"] == "publish")
    if not starts or not published:
        raise MoerlError("the status has no plan/import-sft and publish pods; it is not of a moerl run")
    marks = [min(starts), *published]
    return [b - a for a, b in itertools.pairwise(marks)]


def _read_json(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise MoerlError(f"{path}: cannot read it ({err.strerror}); check the path") from None
    except json.JSONDecodeError as err:
        raise MoerlError(f"{path}: not valid JSON ({err}); pass a step-times or status JSON file") from None
    if not isinstance(data, dict):
        raise MoerlError(f"{path}: expected a JSON object of step name -> seconds, or a workflow status")
    return data


def load_step_times(path: str | Path) -> dict[str, float]:
    """A step-times JSON ({"rollout": 12.5, "update": 30, ...}) or a status JSON, reduced to step times."""
    data = _read_json(path)
    if "nodes" in data or isinstance(data.get("status"), dict):
        return step_times_from_status(data)
    known = (*STEP_KINDS, *CLIENT_KINDS, ENGINE_STARTUP)
    out = {}
    for key, value in data.items():
        if key not in known:
            guess = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else f"use {', '.join(known)}"
            raise MoerlError(f"{path}: unknown step {key!r}; {hint}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or not math.isfinite(value):
            raise MoerlError(f"{path}: {key} must be a number of seconds >= 0, got {value!r}")
        out[key] = float(value)
    return out
