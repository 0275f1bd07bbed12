"""retryStrategy as Argo's controller applies it: policies over Failed and Error attempts, limits,
backoff and its limits, and `expression` over lastRetry.* on the outcomes Argo records (including
those of Spot reclaims and kills)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipelines.local import run_workflow
from pipelines.local.api.manifest import load_workflow
from pipelines.local.api.status import ERROR, FAILED, POD, RETRY, RUNNING, Node, pod_name
from pipelines.local.controller.calls import Opts
from pipelines.local.controller.retries import is_transient, retry_scope
from pipelines.local.controller.workflow_controller import Controller
from pipelines.local.lang.expressions import expand
from pipelines.local.lang.exprlang import evaluate_bool
from pipelines.local.pods.chaos import NODE_SHUTDOWN, POD_DELETED


@pytest.fixture(autouse=True)
def fast_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")


def attempt(phase: str, message: str, exit_code: str | None, seconds: float = 3.0) -> Node:
    node = Node(
        id="a",
        name="wf.x(0)",
        display_name="x(0)",
        type=POD,
        template_name="x",
        phase=phase,
        boundary_id="",
        started_at=1000.0,
        finished_at=1000.0 + seconds,
        message=message,
    )
    node.outputs = {"exitCode": exit_code} if exit_code is not None else None
    return node


RETRY_CONDITIONAL = (
    'asInt(lastRetry.exitCode) > 1 && lastRetry.status != "Error" && asInt(lastRetry.duration) < 120'
    " && (false == true || lastRetry.message matches 'imminent node shutdown|pod deleted')"
)
OUTCOMES = {
    "exit 1": attempt(FAILED, "main: Error (exit code 1)", "1"),
    "exit 2": attempt(FAILED, "main: Error (exit code 2)", "2"),
    "preempted, pod gone": attempt(ERROR, POD_DELETED, None),
    "preempted, TERM handled": attempt(FAILED, NODE_SHUTDOWN, "143"),
    "preempted, killed after grace": attempt(FAILED, NODE_SHUTDOWN, "137"),
    "killed": attempt(ERROR, POD_DELETED, None),
}


@pytest.mark.parametrize(
    ("expression", "retried"),
    [
        ('lastRetry.status == "Error"', {"preempted, pod gone", "killed"}),
        ("asInt(lastRetry.exitCode) in [137, 143]", {"preempted, TERM handled", "preempted, killed after grace"}),
        ("asInt(lastRetry.exitCode) == -1", {"preempted, pod gone", "killed"}),  # no exit code: -1
        (
            "lastRetry.message matches 'imminent node shutdown|pod deleted'",
            {"preempted, pod gone", "preempted, TERM handled", "preempted, killed after grace", "killed"},
        ),
        ("asInt(lastRetry.exitCode) > 1", {"exit 2", "preempted, TERM handled", "preempted, killed after grace"}),
        (RETRY_CONDITIONAL, {"preempted, TERM handled", "preempted, killed after grace"}),
        ("asInt(retries) < 1 && asInt(lastRetry.duration) == 3", set(OUTCOMES)),  # retries is a string, as in Argo
    ],
)
def test_retry_expression_on_the_outcomes_argo_records(expression, retried):
    decided = {name for name, node in OUTCOMES.items() if evaluate_bool(expression, expand(retry_scope([node])))}
    assert decided == retried


def test_lastretry_duration_is_whole_seconds_as_argo_stores_timestamps():
    node = attempt(FAILED, "x", "1")
    node.started_at, node.finished_at = 1000.9, 1002.1  # 1.2 s, but 1000 -> 1002 once stored
    assert retry_scope([node])["lastRetry.duration"] == "2"


def flaky(policy: str | None, limit: int = 2, how: str = "fail", **retry) -> dict:
    commands = {
        "fail": "echo attempt {{retries}}; exit 1",
        "error": "echo attempt {{retries}}",
    }  # no output file: the pod errors
    strategy = {"limit": limit, **({"retryPolicy": policy} if policy else {}), **retry}
    template = {
        "name": "main",
        "retryStrategy": strategy,
        "container": {"image": "a", "command": ["sh", "-c", commands[how]]},
    }
    if how == "error":
        template["outputs"] = {"parameters": [{"name": "p", "valueFrom": {"path": "/tmp/missing"}}]}
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "r-"},
        "spec": {"entrypoint": "main", "templates": [template]},
    }


@pytest.mark.parametrize(
    ("policy", "how", "attempts", "message"),
    [
        (None, "fail", 3, "No more retries left"),  # OnFailure by default
        ("OnFailure", "fail", 3, "No more retries left"),
        ("OnError", "fail", 1, "main: Error (exit code 1)"),
        ("Always", "fail", 3, "No more retries left"),
        ("OnFailure", "error", 1, "wait: Error (exit code 1): open /tmp/missing: no such file or directory"),
        ("OnError", "error", 3, "No more retries left"),
        ("OnTransientError", "fail", 1, "main: Error (exit code 1)"),
    ],
)
def test_retry_policy_decides_which_outcomes_are_retried(tmp_path: Path, policy, how, attempts, message):
    result = run_workflow(flaky(policy, how=how), workdir=tmp_path, view=None)
    root = result.status["nodes"][result.name]
    assert root["type"] == RETRY and root["phase"] == ("Failed" if how == "fail" else "Error")
    assert root["message"] == message
    children = [result.status["nodes"][c] for c in root["children"]]
    assert [c["displayName"] for c in children] == [f"{result.name}({i})" for i in range(attempts)]
    assert all(c["nodeFlag"] == {"retried": True} for c in children)
    for i, child in enumerate(children):  # {{retries}} is the attempt's number
        pod_dir = result.run_dir / "pods" / pod_name(result.name, child["name"], "main")
        assert (pod_dir / "stdout.log").read_text() == f"attempt {i}\n"


def test_retry_expression_stops_the_retries(tmp_path: Path):
    manifest = flaky("Always", limit=5, expression="asInt(lastRetry.exitCode) != 1")
    result = run_workflow(manifest, workdir=tmp_path, view=None)
    root = result.status["nodes"][result.name]
    assert (root["phase"], root["message"], len(root["children"])) == (
        "Failed",
        "retryStrategy.expression evaluated to false",
        1,
    )


def test_transient_errors_are_recognised_by_argos_patterns(monkeypatch: pytest.MonkeyPatch):
    assert is_transient("dial tcp 10.0.0.1:443: connect: connection refused")
    assert not is_transient(POD_DELETED)
    monkeypatch.setenv("TRANSIENT_ERROR_PATTERN", "pod deleted|imminent node shutdown")
    assert is_transient(POD_DELETED) and is_transient(NODE_SHUTDOWN)


def retry_controller(tmp_path: Path, backoff: dict, started_ago: float, finished_ago: float) -> tuple:
    controller = Controller(load_workflow(flaky("Always", limit=10, backoff=backoff)), tmp_path, time_scale=1.0)
    now = time.time()
    retry = controller.nodes.create("wf", RETRY, "main", "", RUNNING, now=now - started_ago)
    first = controller.nodes.create("wf(0)", POD, "main", "", FAILED, now=now - started_ago)
    first.finished_at = now - finished_ago
    retry.children.append(first.id)
    return controller, retry


def test_a_retry_waits_out_its_backoff(tmp_path: Path):
    controller, retry = retry_controller(tmp_path, {"duration": "4"}, started_ago=2, finished_ago=1)
    assert controller.process_retries(retry, controller.wf.spec["templates"][0]["retryStrategy"], Opts()) is False
    assert retry.message == "Backoff for 4 seconds" and retry.phase == RUNNING


@pytest.mark.parametrize(
    ("started_ago", "message"),
    [(120, "Max duration limit exceeded"), (50, "Backoff would exceed max duration limit")],
)
def test_backoff_max_duration_ends_the_retries(tmp_path: Path, started_ago, message):
    backoff = {"duration": "20", "maxDuration": "1m"}
    controller, retry = retry_controller(tmp_path, backoff, started_ago=started_ago, finished_ago=1)
    assert controller.process_retries(retry, {"limit": 10, "backoff": backoff}, Opts()) is True
    assert (retry.phase, retry.message) == (FAILED, message)
