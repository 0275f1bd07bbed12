"""Variables a template can read: what finished steps and tasks expose (`steps.X.outputs.result`,
`tasks.X.outputs.parameters.p`, `steps.X.exitCode`, `steps.X.status`, ...), loop aggregates
(`steps.X.outputs.parameters` as a JSON list), and template outputs taken from that scope.
Mirrors Argo's buildLocalScope, processAggregateNodeOutputs and getTemplateOutputsFromScope.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipelines.local.api.status import OMITTED, RETRY, SKIPPED_PHASE, SUCCEEDED, Node, Nodes, timestamp
from pipelines.local.lang import exprlang
from pipelines.local.lang.expressions import expand
from pipelines.local.lang.functions import go_json, go_string


def last_attempt(node: Node, nodes: Nodes) -> Node | None:
    """The newest attempt under a Retry node (exit-hook children are not attempts)."""
    if node.type != RETRY:
        return None
    for child_id in reversed(node.children):
        child = nodes.get(child_id)
        if child is not None and not child.hooked:
            return child
    return None


def add_node_ref(scope: dict, prefix: str, name: str, node: Node, nodes: Nodes) -> None:
    """{{steps.NAME.*}} / {{tasks.NAME.*}} of one node (of its last attempt, for a Retry node)."""
    node = last_attempt(node, nodes) or node
    base = f"{prefix}.{name}"
    scope[f"{base}.id"] = node.id
    scope[f"{base}.startedAt"] = timestamp(node.started_at)
    if node.finished_at is not None:
        scope[f"{base}.finishedAt"] = timestamp(node.finished_at)
    scope[f"{base}.status"] = node.phase
    if node.type == "Pod":  # every pod's IP is this machine's loopback (a daemon's server listens there)
        scope[f"{base}.ip"] = "127.0.0.1"
    outputs = node.outputs or {}
    if "result" in outputs:
        scope[f"{base}.outputs.result"] = outputs["result"]
    if "exitCode" in outputs:
        scope[f"{base}.exitCode"] = outputs["exitCode"]
    for param in outputs.get("parameters") or []:
        if param.get("value") is not None:
            scope[f"{base}.outputs.parameters.{param['name']}"] = param["value"]


def add_skipped_outputs(scope: dict, prefix: str, name: str, node: Node, template: dict | None) -> None:
    """A skipped or omitted node's declared outputs: the producer's default, else absent (None)."""
    if template is None or node.outputs is not None or node.phase not in (SKIPPED_PHASE, OMITTED):
        return
    for param in (template.get("outputs") or {}).get("parameters") or []:
        default = (param.get("valueFrom") or {}).get("default")
        scope[f"{prefix}.{name}.outputs.parameters.{param['name']}"] = None if default is None else str(default)


def loop_index(name: str) -> int:
    return int(name.rsplit("(", 1)[-1].split(":", 1)[0])


def add_aggregate(scope: dict, prefix: str, name: str, children: list[Node]) -> None:
    """The outputs of a loop's iterations as JSON lists, in item order (Succeeded ones only)."""
    children = sorted((c for c in children if not c.hooked and not c.retried), key=lambda c: loop_index(c.name))
    if not children:
        return
    results: list[Any] = []
    parameter_maps: list[dict] = []
    by_name: dict[str, list[str]] = {}
    for child in children:
        outputs = child.outputs or {}
        if child.phase != SUCCEEDED or not outputs:
            continue
        params = outputs.get("parameters") or []
        if params:
            parameter_maps.append({p["name"]: str(p.get("value")) for p in params})
            for p in params:
                by_name.setdefault(p["name"], []).append(str(p.get("value")))
        if "result" in outputs:
            try:
                results.append(json.loads(outputs["result"]))
            except json.JSONDecodeError:
                results.append(outputs["result"])
    scope[f"{prefix}.{name}.outputs.result"] = go_json(results)
    scope[f"{prefix}.{name}.outputs.parameters"] = go_json(parameter_maps)
    for param_name, values in by_name.items():
        decoded = []
        for value in values:
            try:
                item = json.loads(value)
            except json.JSONDecodeError:
                break
            if not isinstance(item, dict | list):
                break
            decoded.append(item)
        aggregated = decoded if len(decoded) == len(values) else values
        scope[f"{prefix}.{name}.outputs.parameters.{param_name}"] = go_json(aggregated)


class UnresolvedOutput(Exception):
    pass


def resolve_var(text: str, scope: dict) -> Any:
    """Argo's ResolveVar: "{{name}}" or "{{=expr}}" to its value."""
    tag = text.strip()
    if tag.startswith("{{") and tag.endswith("}}"):
        tag = tag[2:-2].strip()
    if tag.startswith("="):
        try:
            value = exprlang.evaluate(tag[1:], expand(scope))
        except exprlang.ExprError as err:
            raise UnresolvedOutput(f"Unable to resolve: {{{{{tag}}}}}: {err}") from err
        if value is None:
            raise UnresolvedOutput(f"Unable to resolve: {{{{{tag}}}}}")
        return value
    if tag not in scope:
        raise UnresolvedOutput(f"Unable to resolve: {{{{{tag}}}}}")
    return scope[tag]


def template_outputs(template: dict, scope: dict) -> dict | None:
    """A steps or DAG template's outputs.parameters, from valueFrom.parameter or .expression."""
    params = (template.get("outputs") or {}).get("parameters") or []
    if not params:
        return None
    out = []
    for param in params:
        source = param.get("valueFrom") or {}
        if "valueFrom" not in param and param.get("value") is not None:  # a literal output value
            out.append(dict(param))
            continue
        try:
            if source.get("parameter") is not None:
                value = resolve_var(str(source["parameter"]), scope)
            else:
                value = resolve_var("=" + str(source.get("expression")), scope)
        except UnresolvedOutput:
            if "default" not in source:
                raise
            value = source["default"]
        if value is None:
            if "default" not in source:
                raise UnresolvedOutput(
                    f"output parameter {param['name']!r}: {source.get('parameter')!r} is an absent optional "
                    f"(skipped/omitted node output with no default)"
                )
            value = source["default"]
        text = (
            value
            if isinstance(value, str)
            else go_string(value)
            if not isinstance(value, dict | list)
            else go_json(value)
        )
        out.append({**{k: v for k, v in param.items() if k != "valueFrom"}, "value": text})
    return {"parameters": out}


def step_or_task_name(node_name: str) -> str:
    """Argo's getStepOrDAGTaskName: "wf[0].fanout(0:1)(0)" -> "fanout"."""
    opener = ""
    for i in range(len(node_name) - 1, -1, -1):
        char = node_name[i]
        if char == opener:
            opener = ""
        elif opener:
            continue
        elif char == ")":
            opener = "("
        elif char == "]":
            opener = "["
        else:
            node_name = node_name[: i + 1]
            break
    return node_name.rsplit(".", 1)[-1]


def result_referenced(parent_template: dict | None, node_name: str) -> bool:
    """Argo captures a pod's stdout as outputs.result only when the template around it names
    `steps.NAME.outputs.result` (or `tasks.`, or `steps['NAME'].outputs.result` in an expression)."""
    if parent_template is None:
        return False
    name = re.escape(step_or_task_name(node_name))
    kind = "tasks" if "dag" in parent_template else "steps" if "steps" in parent_template else ""
    text = json.dumps(parent_template)
    reference = rf"{kind}\.{name}\.outputs\.result"
    expression = rf"{kind}\[\\?['\"]{name}\\?['\"]\]\.outputs.result"
    return re.search(reference, text) is not None or re.search(expression, text) is not None
