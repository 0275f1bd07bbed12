"""Steps templates, as Argo's workflow/controller/steps.go walks them.

    wf                      Steps      (the template)
    wf[0]                   StepGroup  (the first list of parallel steps)
    wf[0].generate          Pod        (a step)
    wf[1]                   StepGroup  (a child of the pods that ended group 0)
    wf[1].sleep(0:20)       Pod        (one item of a withParam loop)
    wf[1].print.onExit      ...        (a step's exit hook)

A group starts when the one before it succeeded. Its steps are substituted with what the earlier
groups produced (`steps.X.*`, strictly: a reference that does not resolve is an error), expanded
over their items, checked against `when`, and executed. The group succeeds when all its children
are done and none failed or errored (unless the step has continueOn); the template then fails
with the group's message "child 'ID' failed".
"""

from __future__ import annotations

from typing import Any

from pipelines.local.api.status import (
    ERROR,
    FAILED,
    RUNNING,
    SKIPPED,
    SKIPPED_PHASE,
    STEP_GROUP,
    STEPS,
    SUCCEEDED,
    Node,
)
from pipelines.local.controller.calls import Call, Opts, TemplateError, continues_on, exit_hook_of
from pipelines.local.controller.host import WalkerHost
from pipelines.local.controller.loops import ExpandError, expand, loops
from pipelines.local.controller.scope import (
    UnresolvedOutput,
    add_aggregate,
    add_node_ref,
    add_skipped_outputs,
    template_outputs,
)
from pipelines.local.lang.expressions import SubstitutionError, WhenError, evaluate_when, substitute

STRICT = ("steps", "tasks")
ABSENT_OPTIONAL = "__argo-internal.absent-optional-output__"  # Argo's AbsentOptionalArgumentValue


def execute_steps(ctl: WalkerHost, node_name: str, template: dict, opts: Opts, scope_key: Any) -> Node:
    node = ctl.nodes.by_name(node_name) or ctl.create_node(node_name, STEPS, template, opts, RUNNING)
    ctl.node_templates[node.id] = template
    scope: dict[str, Any] = {}
    for i, group in enumerate(template["steps"]):
        group_name = f"{node_name}[{i}]"
        group_node = ctl.nodes.by_name(group_name)
        if group_node is None:
            group_node = ctl.nodes.create(group_name, STEP_GROUP, "", node.id, RUNNING, display_parent=node.id)
            link_group(ctl, node_name, i)
        group_node = execute_group(ctl, group or [], group_node, node, scope, opts, scope_key)
        if not group_node.fulfilled:
            return node
        if group_node.failed_or_error:
            update_outbound(ctl, node, len(template["steps"]))
            return ctl.nodes.mark(node, FAILED, group_node.message)
        add_group_outputs(ctl, group or [], group_node, node, scope, scope_key)
    update_outbound(ctl, node, len(template["steps"]))
    return succeed_with_outputs(ctl, node, template, scope)


def succeed_with_outputs(ctl: WalkerHost, node: Node, template: dict, scope: dict[str, Any]) -> Node:
    """A steps or DAG node whose children all succeeded: its outputs resolved from their scope, then
    Succeeded, or Error when an output cannot be resolved."""
    inputs = (template.get("inputs") or {}).get("parameters") or []  # Argo's createScope puts the inputs in
    own = {f"inputs.parameters.{p['name']}": p.get("value") for p in inputs if p.get("value") is not None}
    try:
        outputs = template_outputs(template, {**ctl.globals(), **own, **scope})
    except UnresolvedOutput as err:
        return ctl.nodes.mark(node, ERROR, str(err))
    if outputs is not None:
        node.outputs = outputs
        ctl.add_global_outputs(outputs)
    return ctl.nodes.mark(node, SUCCEEDED)


def link_group(ctl: WalkerHost, node_name: str, index: int) -> None:
    """The first group hangs from the template's node, each later one from the outbound nodes of
    the group before it (or from that group itself, when it had no steps)."""
    group_name = f"{node_name}[{index}]"
    if index == 0:
        ctl.nodes.add_child(node_name, group_name)
        return
    previous = ctl.nodes.by_name(f"{node_name}[{index - 1}]")
    assert previous is not None
    if not previous.children:
        ctl.nodes.add_child(previous.name, group_name)
    for child_id in list(previous.children):
        for out_id in ctl.outbound_nodes(child_id):
            ctl.nodes.add_child(ctl.nodes.by_id[out_id].name, group_name)


def update_outbound(ctl: WalkerHost, node: Node, groups: int) -> None:
    for i in reversed(range(groups)):
        group = ctl.nodes.by_name(f"{node.name}[{i}]")
        if group is not None:
            node.outbound_nodes = [
                out
                for child in group.children
                for out in ctl.outbound_nodes(child)
                if ctl.nodes.by_id[child].type != STEP_GROUP
            ]
            return


def resolve_step(step: dict, scope: dict[str, Any]) -> dict:
    """Substitute a step with the outputs of earlier groups (Argo's resolveReferences): `when`
    first, and a step that will not run is left otherwise as it is."""
    step = dict(step)
    hooks = step.pop("hooks", None)
    if step.get("when"):
        when = substitute(step["when"], scope, STRICT)
        try:
            if not evaluate_when(when):
                return {**step, "when": when, **({"hooks": hooks} if hooks else {})}
        except WhenError:
            if not loops(step):
                raise
    drop_absent_arguments(step, scope)
    resolved = substitute(step, scope, STRICT)
    if hooks:
        resolved["hooks"] = hooks
    return resolved


def drop_absent_arguments(step: dict, scope: dict[str, Any]) -> None:
    """An argument that is exactly a reference to a skipped step's output without a default is
    marked absent, so that the input's own default applies, or the input errors with Argo's message
    (markAbsentOptionalArgs; ProcessArgs reads the mark)."""
    params = (step.get("arguments") or {}).get("parameters")
    if not params:
        return

    def absent(value: object) -> bool:
        if not (isinstance(value, str) and value.startswith("{{") and value.endswith("}}")):
            return False
        name = value[2:-2].strip()
        return name in scope and scope[name] is None

    marked = [{**param, "value": ABSENT_OPTIONAL} if absent(param.get("value")) else param for param in params]
    step["arguments"] = {**step["arguments"], "parameters": marked}


def execute_group(
    ctl: WalkerHost, group: list[dict], group_node: Node, steps_node: Node, scope: dict, opts: Opts, scope_key: Any
) -> Node:
    nodes = ctl.nodes
    if group_node.fulfilled and all(nodes.by_id[c].fulfilled for c in group_node.children):
        return group_node
    merged = {**ctl.globals(), **scope}
    try:
        resolved = [resolve_step(step, merged) for step in group]
    except (SubstitutionError, WhenError) as err:
        return nodes.mark(group_node, ERROR, f"failed to resolve references: {err}")
    expanded: list[dict] = []
    for step in resolved:
        if not loops(step):
            expanded.append(step)
            continue
        try:
            copies = expand(step)
        except (ExpandError, SubstitutionError) as err:
            return nodes.mark(group_node, ERROR, str(err))
        if not copies:
            skip(ctl, step, group_node, steps_node, SKIPPED_PHASE, "Skipped, empty params")
        expanded += copies

    steps_by_node: dict[str, dict] = {}
    for step in expanded:
        child_name = f"{group_node.name}.{step['name']}"
        try:
            proceed = evaluate_when(step.get("when") or "")
        except WhenError as err:
            skip(ctl, step, group_node, steps_node, ERROR, str(err))
            return nodes.mark(group_node, ERROR, str(err))
        if not proceed:
            skip(ctl, step, group_node, steps_node, SKIPPED_PHASE, f"when '{step['when']}' evaluated false")
            continue
        child = ctl.execute_template(
            child_name,
            Call(step, "step", scope_key),
            Opts(boundary_id=steps_node.id, display_parent=group_node.id, on_exit=opts.on_exit),
        )
        if child is not None:
            steps_by_node[child.name] = step
            nodes.add_child(group_node.name, child_name)

    completed = True
    children = [nodes.by_id[c] for c in group_node.children if nodes.by_id[c].type != STEP_GROUP]
    for child in children:
        step = steps_by_node.get(child.name)
        if not child.fulfilled:
            completed = False
        elif child.completed and step is not None and (hook := exit_hook_of(step)) is not None:
            hook_scope = {**merged}
            hook_node = ctl.run_exit_hook(hook, child, steps_node.id, hook_scope, "steps", step["name"], scope_key)
            if hook_node is None or not hook_node.fulfilled:
                completed = False
    if not completed:
        if group_node.fulfilled:
            group_node.phase = RUNNING
        return group_node
    for child in children:
        if child.failed_or_error and not continues_on(steps_by_node.get(child.name), child.phase):
            return nodes.mark(group_node, FAILED, f"child '{child.id}' failed")
    return nodes.mark(group_node, SUCCEEDED)


def skip(ctl: WalkerHost, step: dict, group_node: Node, steps_node: Node, phase: str, message: str) -> None:
    """A step that does not run: a node of type Skipped, once, in the group."""
    name = f"{group_node.name}.{step['name']}"
    if ctl.nodes.by_name(name) is None:
        template_name = str(step.get("template", ""))
        ctl.nodes.create(
            name, SKIPPED, template_name, steps_node.id, phase, message=message, display_parent=group_node.id
        )
        ctl.nodes.add_child(group_node.name, name)


def add_group_outputs(
    ctl: WalkerHost, group: list[dict], group_node: Node, steps_node: Node, scope: dict, scope_key: Any
) -> None:
    """What a finished group leaves for the groups after it: `steps.NAME.*`, and for a loop the
    JSON lists of its items' outputs."""
    for step in group:
        name = step["name"]
        child_name = f"{group_node.name}.{name}"
        child = ctl.nodes.by_name(child_name)
        if child is None:
            iterations = [
                n
                for n in ctl.nodes
                if n.boundary_id == steps_node.id and n.name.startswith(child_name + "(") and n.type != SKIPPED
            ]
            add_aggregate(scope, "steps", name, iterations)
            add_node_ref(scope, "steps", name, group_node, ctl.nodes)
            continue
        add_node_ref(scope, "steps", name, child, ctl.nodes)
        try:
            template, _ = ctl.resolve(Call(step, "step", scope_key))
        except TemplateError:
            template = None
        add_skipped_outputs(scope, "steps", name, child, template)
