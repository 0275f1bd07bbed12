"""Spot semantics: the retry expression retries exactly the preemptions, never a program's own failure; Spot
roles retry Always with backoff on another node, on-demand roles only on Argo errors."""

from __future__ import annotations

import re

import pytest

from pipelines.workflow import workflow
from pipelines.workflow.retry import SPOT_RETRY_EXPRESSION
from steps.run.config import validate_config

BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}

# How Argo records an attempt: (status, exitCode, message) -> should the Spot step be retried?
OUTCOMES = [
    ("Error", "-1", "pod deleted", True),  # the node vanished with the pod
    ("Error", "", "pod deleted", True),
    ("Failed", "143", "Pod was terminated in response to imminent node shutdown.", True),
    ("Failed", "-1", "Pod was terminated in response to imminent node shutdown.", True),
    ("Failed", "137", "The node was low on resource: memory. Threshold quantity: 100Mi, available: 1Mi.", True),
    ("Failed", "-1", "The node was low on resource: ephemeral-storage.", True),
    ("Failed", "143", "Error (exit code 143)", True),  # SIGTERM mid-run, the rollout kept its chunks
    ("Failed", "137", "Error (exit code 137)", True),  # SIGKILL after the grace period
    ("Failed", "1", "Error (exit code 1)", False),  # a bug: fails the same way on any node
    ("Failed", "2", "Error (exit code 2)", False),  # a MoerlError: bad input, the message says what to fix
    ("Failed", "3", "Error (exit code 3)", False),
    ("Failed", "1", "OOMKilled (exit code 1)", False),
]


# --- a minimal evaluator of the expr-lang subset the expression uses ------------------------------------

_TOKEN = re.compile(r'\s*(\|\||&&|==|!=|!|\(|\)|\[|\]|,|"(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_.]*)')


def tokenize(source: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(source.rstrip()):
        match = _TOKEN.match(source, pos)
        assert match, f"cannot tokenize at {source[pos:]!r}"
        tokens.append(match.group(1))
        pos = match.end()
    return tokens


def evaluate(source: str, env: dict[str, str]) -> bool:
    tokens = tokenize(source)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take(expected: str | None = None) -> str:
        nonlocal pos
        token = tokens[pos]
        assert expected is None or token == expected, (token, expected)
        pos += 1
        return token

    def primary() -> object:
        token = take()
        if token == "(":
            value = disjunction()
            take(")")
            return value
        if token == "[":
            items = [primary()]
            while peek() == ",":
                take(",")
                items.append(primary())
            take("]")
            return items
        if token.startswith('"'):
            return token[1:-1]
        return env[token]  # a variable such as lastRetry.status

    def comparison() -> object:
        if peek() == "!":
            take()
            return not comparison()
        left = primary()
        op = peek()
        if op in ("==", "!="):
            take()
            right = primary()
            return (left == right) if op == "==" else (left != right)
        if op == "matches":
            take()
            return re.search(str(primary()), str(left)) is not None
        if op == "in":
            take()
            return left in primary()
        return left

    def conjunction() -> object:
        value = comparison()
        while peek() == "&&":
            take()
            right = comparison()
            value = bool(value) and bool(right)
        return value

    def disjunction() -> object:
        value = conjunction()
        while peek() == "||":
            take()
            right = conjunction()
            value = bool(value) or bool(right)
        return value

    result = disjunction()
    assert pos == len(tokens), f"trailing tokens: {tokens[pos:]}"
    return bool(result)


def last_retry(status: str, exit_code: str, message: str) -> dict[str, str]:
    return {"lastRetry.status": status, "lastRetry.exitCode": exit_code, "lastRetry.message": message,
            "lastRetry.duration": "12"}  # fmt: skip


@pytest.mark.parametrize(("status", "exit_code", "message", "retried"), OUTCOMES)
def test_the_expression_retries_preemptions_and_not_bugs(status, exit_code, message, retried):
    assert evaluate(SPOT_RETRY_EXPRESSION, last_retry(status, exit_code, message)) is retried


@pytest.mark.parametrize(("status", "exit_code", "message", "retried"), OUTCOMES)
def test_the_local_executors_expr_lang_agrees(status, exit_code, message, retried):
    exprlang = pytest.importorskip("pipelines.local.lang.exprlang")
    env = {"lastRetry": {"status": status, "exitCode": exit_code, "message": message, "duration": "12"}}
    assert exprlang.evaluate_bool(SPOT_RETRY_EXPRESSION, env) is retried


def templates_of(cfg_data: dict) -> dict[str, dict]:
    manifest = workflow(validate_config({**BASE, **cfg_data})).to_dict()
    return {t["name"]: t for t in manifest["spec"]["templates"]}


@pytest.mark.parametrize("nodes", [1, 2])
def test_spot_roles_retry_always_elsewhere_and_on_demand_roles_on_error_only(nodes):
    retries = {"rollout": {"limit": 7, "backoff": {"duration": "30s", "factor": 3, "max_duration": "2h", "cap": "5m"}}}
    templates = templates_of({"retries": retries, "trainer": {"nodes": nodes}})
    for name in ("rollout", "score"):
        strategy = templates[name]["retryStrategy"]
        assert strategy["retryPolicy"] == "Always"
        assert strategy["expression"] == SPOT_RETRY_EXPRESSION
        assert strategy["affinity"] == {"nodeAntiAffinity": {}}
        assert templates[name]["nodeSelector"] == {"karpenter.sh/capacity-type": "spot"}
    assert templates["rollout"]["retryStrategy"]["limit"] == 7
    assert templates["rollout"]["retryStrategy"]["backoff"] == {"duration": "30s", "factor": 3, "maxDuration": "2h",
                                                                "cap": "5m"}  # fmt: skip
    for name in ("update", "publish", "plan", "import-sft"):
        strategy = templates[name]["retryStrategy"]
        assert strategy["retryPolicy"] == "OnError" and "expression" not in strategy and "affinity" not in strategy
    # Off Spot: on-demand or reserved (Karpenter labels ODCR and Capacity Block nodes `reserved`).
    assert "nodeSelector" not in templates["publish"]
    assert templates["publish"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand", "reserved"]}]}]
    }  # fmt: skip


def test_the_capacity_label_can_be_turned_off_or_set_by_hand():
    templates = templates_of({"capacity_label": None})
    assert "nodeSelector" not in templates["rollout"]
    templates = templates_of({"placement": {"rollout": {"node_selector": {"karpenter.sh/capacity-type": "spot,x"}}}})
    assert templates["rollout"]["nodeSelector"] == {"karpenter.sh/capacity-type": "spot,x"}
