"""DAG templates, as Argo's workflow/controller/dag.go walks them.

    wf              DAG        (the template)
    wf.A            Pod        (a task; its children are the tasks that depend on it)
    wf.B            TaskGroup  (a task with withItems/withParam/withSequence)
    wf.B(0:x)       Pod        (one of its items)

Starting from the target tasks (`dag.target`, else every task nothing depends on), each task first
walks its dependencies; once they are all done its `depends` expression (depends.py) decides
whether it runs or is Omitted. The DAG's phase comes from a walk of the finished graph in which an
omitted task inherits the phase of the branch above it (assess_phase).
"""

from __future__ import annotations

from typing import Any

from pipelines.local.api.depends import evaluate_depends, task_dependencies, task_results
from pipelines.local.api.status import (
    DAG,
    ERROR,
    OMITTED,
    RETRY,
    RUNNING,
    SKIPPED,
    SKIPPED_PHASE,
    SUCCEEDED,
    TASK_GROUP,
    Node,
    failed_or_error,
)
from pipelines.local.controller.calls import Call, Opts, TemplateError, continues_on, exit_hook_of
from pipelines.local.controller.host import WalkerHost
from pipelines.local.controller.loops import ExpandError, expand, loops
from pipelines.local.controller.scope import (
    add_aggregate,
    add_node_ref,
    add_skipped_outputs,
)
from pipelines.local.controller.steps_template import resolve_step, succeed_with_outputs
from pipelines.local.lang.expressions import SubstitutionError, WhenError, evaluate_when


def execute_dag(ctl: WalkerHost, node_name: str, template: dict, opts: Opts, scope_key: Any) -> Node:
    node = ctl.nodes.by_name(node_name) or ctl.create_node(node_name, DAG, template, opts, RUNNING)
    ctl.node_templates[node.id] = template
    dag = DagWalk(ctl, node, template, opts, scope_key)
    for name in dag.tasks:  # Argo's "pre-execute daemoned tasks": a lost daemon is retried on every pass
        if (task_node := dag.task_node(name)) is not None and task_node.daemoned:
            dag.execute_task(name)
    targets = str(template["dag"].get("target") or "").split() or dag.leaf_tasks()
    for target in targets:
        dag.execute_task(target)
    phase = dag.assess_phase(targets)
    if phase == RUNNING:
        return node
    node.outbound_nodes = [out for t in targets if (n := dag.task_node(t)) for out in ctl.outbound_nodes(n.id)]
    if failed_or_error(phase):
        return ctl.nodes.mark(node, phase)
    scope: dict[str, Any] = {}
    for name in dag.tasks:
        task_node = dag.task_node(name)
        if task_node is not None:
            dag.add_task_scope(scope, name, task_node)
            ctl.add_global_outputs(task_node.outputs)
    return succeed_with_outputs(ctl, node, template, scope)


class DagWalk:
    """One pass over one DAG node (Argo's dagContext)."""

    def __init__(self, ctl: WalkerHost, node: Node, template: dict, opts: Opts, scope_key: Any):
        self.ctl = ctl
        self.node = node
        self.opts = opts
        self.scope_key = scope_key
        self.tasks: dict[str, dict] = {t["name"]: t for t in template["dag"]["tasks"]}
        self.fail_fast = template["dag"].get("failFast") is not False
        self.visited: set[str] = set()
        self.dependencies = {name: task_dependencies(task, self.tasks) for name, task in self.tasks.items()}

    def task_node(self, name: str) -> Node | None:
        return self.ctl.nodes.by_name(f"{self.node.name}.{name}")

    def leaf_tasks(self) -> list[str]:
        depended_on = {dep for deps, _ in self.dependencies.values() for dep in deps}
        return sorted(name for name in self.tasks if name not in depended_on)

    def ancestors(self, name: str) -> list[str]:
        seen: list[str] = []

        def visit(task: str) -> None:
            for dep in self.dependencies[task][0]:
                if dep not in seen:
                    visit(dep)
                    seen.append(dep)

        visit(name)
        return seen

    def add_task_scope(self, scope: dict, name: str, node: Node) -> None:
        if node.type == TASK_GROUP:
            iterations = [
                n for n in self.ctl.nodes if n.boundary_id == self.node.id and n.name.startswith(node.name + "(")
            ]
            add_aggregate(scope, "tasks", name, iterations)
        add_node_ref(scope, "tasks", name, node, self.ctl.nodes)
        add_skipped_outputs(scope, "tasks", name, node, self.template_of(self.tasks[name]))

    def template_of(self, task: dict) -> dict | None:
        try:
            return self.ctl.resolve(Call(task, "task", self.scope_key))[0]
        except TemplateError:
            return None

    def task_scope(self, name: str) -> dict[str, Any]:
        scope: dict[str, Any] = {}
        for ancestor in self.ancestors(name):
            node = self.task_node(ancestor)
            if node is not None:
                self.add_task_scope(scope, ancestor, node)
        return scope

    def connect(self, name: str, child_name: str, group: Node | None) -> None:
        """A task hangs from the DAG (a root task), from its TaskGroup (an item), or from the
        outbound nodes of its dependencies."""
        nodes = self.ctl.nodes
        deps = self.dependencies[name][0]
        if group is not None:
            nodes.add_child(group.name, child_name)
        elif not deps:
            nodes.add_child(self.node.name, child_name)
        else:
            for dep in deps:
                dep_node = self.task_node(dep)
                for out_id in self.ctl.outbound_nodes(dep_node.id) if dep_node else []:
                    nodes.add_child(nodes.by_id[out_id].name, child_name)

    def skip(self, name: str, node_name: str, phase: str, message: str, group: Node | None) -> None:
        if self.ctl.nodes.by_name(node_name) is None:
            display_parent = group.id if group is not None else self.node.id
            template_name = str(self.tasks[name].get("template", ""))
            self.ctl.nodes.create(
                node_name, SKIPPED, template_name, self.node.id, phase, message=message, display_parent=display_parent
            )
            self.connect(name, node_name, group)

    def execute_task(self, name: str) -> None:
        if name in self.visited:
            return
        self.visited.add(name)
        task = self.tasks[name]
        node = self.task_node(name)
        if node is not None and self.ctl.settled(node):
            self.run_hook(name, node)
            return
        node_name = f"{self.node.name}.{name}"
        deps, logic = self.dependencies[name]
        group = node if node is not None and node.type == TASK_GROUP else None
        if logic and node is None:
            for dep in deps:
                self.execute_task(dep)
            try:
                execute = self.depends_satisfied(name)
            except ValueError as err:
                self.skip(name, node_name, ERROR, str(err), None)
                return
            if execute is None:
                return
            if not execute:
                self.skip(name, node_name, OMITTED, "omitted: depends condition not met", None)
                return
        scope = {**self.ctl.globals(), **self.task_scope(name)}
        try:
            resolved = resolve_step(task, scope)
            expanded = expand(resolved) if loops(resolved) else [resolved]
        except (SubstitutionError, WhenError, ExpandError) as err:
            self.skip(name, node_name, ERROR, str(err), None)
            return
        if loops(task):
            if not expanded:
                self.skip(name, node_name, SKIPPED_PHASE, "Skipped, empty params", None)
                return
            if group is None:
                self.connect(name, node_name, None)
                template_name = str(task.get("template", ""))
                group = self.ctl.nodes.create(
                    node_name, TASK_GROUP, template_name, self.node.id, RUNNING, display_parent=self.node.id
                )
        for item in expanded:
            item_name = f"{self.node.name}.{item['name']}"
            if self.ctl.nodes.by_name(item_name) is None:
                try:
                    proceed = evaluate_when(item.get("when") or "")
                except WhenError as err:
                    self.skip(name, item_name, ERROR, str(err), group)
                    continue
                if not proceed:
                    self.skip(name, item_name, SKIPPED_PHASE, f"when '{item['when']}' evaluated false", group)
                    continue
                connect_first = True
            else:
                connect_first = False
            item_node = self.ctl.execute_template(
                item_name,
                Call(item, "task", self.scope_key),
                Opts(
                    boundary_id=self.node.id,
                    display_parent=group.id if group else self.node.id,
                    on_exit=self.opts.on_exit,
                ),
            )
            if item_node is None:
                return
            if connect_first:
                self.connect(name, item_name, group)
            if item_node.completed and exit_hook_of(task) is not None:
                hook_node = self.run_hook(name, item_node)
                if hook_node is None or not hook_node.fulfilled:
                    return
        if group is not None:
            phase = SUCCEEDED
            for item in expanded:
                item_node = self.ctl.nodes.by_name(f"{self.node.name}.{item['name']}")
                if item_node is None or not item_node.fulfilled:
                    return
                if item_node.failed_or_error:
                    phase = item_node.phase
            self.ctl.nodes.mark(group, phase)

    def run_hook(self, name: str, node: Node) -> Node | None:
        hook = exit_hook_of(self.tasks[name])
        if hook is None or not node.completed or node.type == TASK_GROUP:
            return None
        scope = {**self.ctl.globals(), **self.task_scope(name)}
        return self.ctl.run_exit_hook(hook, node, self.node.id, scope, "tasks", name, self.scope_key)

    def depends_satisfied(self, name: str) -> bool | None:
        """None while a dependency (or its exit hook) is still running; else whether to run."""
        results = {}
        for dep in self.dependencies[name][0]:
            node = self.task_node(dep)
            if node is None or not node.fulfilled:
                return None
            if any(
                not self.ctl.nodes.by_id[c].fulfilled
                for c in node.children
                if c in self.ctl.nodes.by_id and self.ctl.nodes.by_id[c].hooked
            ):
                return None
            child_phases = [self.ctl.nodes.by_id[c].phase for c in node.children] if node.type == TASK_GROUP else None
            results[dep] = task_results(node.phase, child_phases, node.daemoned)
        return evaluate_depends(self.dependencies[name][1], results)

    def assess_phase(self, targets: list[str]) -> str:
        """Argo's assessDAGPhase: Running until every node reachable from the DAG is done; then
        Succeeded unless a target's branch ended Failed or Errored (omitted tasks inherit the phase
        of the branch that led to them) and that target does not continueOn it."""
        nodes = self.ctl.nodes
        target_phases = {
            nodes.by_name(f"{self.node.name}.{t}").id if nodes.by_name(f"{self.node.name}.{t}") else f"missing:{t}": ""
            for t in targets
        }
        queue = [(child, SUCCEEDED) for child in self.node.children]
        seen = set(queue)
        while queue:
            node_id, branch = queue.pop(0)
            node = nodes.get(node_id)
            if node is None or not node.fulfilled:
                return RUNNING
            if node.completed:
                branch = node.phase
            if node_id in target_phases and not failed_or_error(target_phases[node_id]):
                target_phases[node_id] = branch
            if node.type == RETRY:  # a Retry node's phase is its last attempt's: walk on below them
                children = []
                for child_id in reversed(node.children):
                    child = nodes.by_id[child_id]
                    children += [child_id] if child.hooked else child.children
            else:
                children = node.children
            for child in children:
                if (child, branch) not in seen:
                    seen.add((child, branch))
                    queue.append((child, branch))
        result = SUCCEEDED
        for target in targets:
            node = nodes.by_name(f"{self.node.name}.{target}")
            phase = target_phases[node.id] if node is not None else ""
            if phase == "":
                result = RUNNING
                if not self.fail_fast:
                    break
            elif failed_or_error(phase):
                if continues_on(self.tasks[target], phase):
                    continue
                result = phase
                if self.fail_fast:
                    break
        return result
