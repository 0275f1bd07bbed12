"""What Argo's validator (workflow/validate/validate.go) refuses before a workflow runs, checked on the
resolved spec: entrypoint and template references, arguments and inputs, expressions, loops, retries,
dependencies and their cycles."""

from __future__ import annotations

import re
from typing import Any

import yaml

from pipelines.durations import parse_duration
from pipelines.local.api.depends import task_dependencies
from pipelines.local.api.fields import (
    LEAF_TYPES,
    RETRY_POLICIES,
    TEMPLATE_TYPES,
    check_fields,
    merge_defaults,
)
from pipelines.local.lang import exprlang
from pipelines.local.lang.functions import BUILTINS, SPRIG
from steps.errors import MoerlError


def validate_spec(spec: dict, library: dict, where: str, entrypoints: dict[str, list[str]] | None = None) -> None:
    """Argo's submit-time validation, for what can go wrong before anything runs."""
    templates = spec.get("templates") or []
    by_name: dict[str, dict] = {}
    for i, template in enumerate(templates):
        name = template.get("name")
        if not name:
            raise MoerlError(f"{where}: spec.templates[{i}].name is required")
        if name in by_name:
            raise MoerlError(f"{where}: spec.templates[{i}].name {name!r} is not unique")
        by_name[name] = template
    entrypoint = spec.get("entrypoint")
    if not entrypoint:
        raise MoerlError(f"{where}: spec.entrypoint is required; name the template to start with")
    check = _Checker(spec, by_name, library, where, entrypoints or {})
    check.reference({"template": entrypoint}, "spec.entrypoint", spec.get("arguments") or {})
    if spec.get("onExit"):
        check.reference({"template": spec["onExit"]}, "spec.onExit", {})
    for hook_name, hook in (spec.get("hooks") or {}).items():
        check.hook(hook_name, hook, "spec.hooks")
    if spec.get("parallelism") is not None:
        check.positive_int(spec["parallelism"], "spec.parallelism")
    if spec.get("activeDeadlineSeconds") is not None:
        check.positive_int(spec["activeDeadlineSeconds"], "spec.activeDeadlineSeconds")
    if spec.get("retryStrategy") is not None:
        check.retry_strategy(spec["retryStrategy"], "spec.retryStrategy")
    for i, template in enumerate(templates):
        check.template(template, f"spec.templates[{i}]")
    # Every WorkflowTemplate reached through templateRef, whole; its templates call each other by name
    # (templateresolution/context.go WithTemplateHolder: a referenced template resolves in its own holder).
    checked: set[tuple[bool, str]] = set()
    while pending := [key for key in check.referenced_library if key not in checked]:
        for key in pending:
            checked.add(key)
            check.by_name = library[key]
            kind = "ClusterWorkflowTemplate" if key[0] else "WorkflowTemplate"
            for name, template in library[key].items():
                check.template(template, f"{kind} {key[1]}.templates.{name}")


class _Checker:
    def __init__(self, spec: dict, by_name: dict, library: dict, where: str, entrypoints: dict[str, list[str]]):
        self.spec = spec
        self.entrypoints = entrypoints
        self.by_name = by_name
        self.library = library
        self.where = where
        self.referenced_library: dict[tuple[bool, str], set[str]] = {}

    def fail(self, message: str) -> None:
        raise MoerlError(f"{self.where}: {message}")

    def target(self, holder: dict, path: str, scope: dict | None = None) -> dict:
        scope = self.by_name if scope is None else scope
        if holder.get("templateRef"):
            ref = holder["templateRef"]
            key = (bool(ref.get("clusterScope")), str(ref.get("name")))
            templates = self.library.get(key)
            if templates is None or ref.get("template") not in templates:
                self.fail(
                    f"{path}: template reference {ref.get('name')}.{ref.get('template')} not found; put the "
                    f"WorkflowTemplate's manifest beside this one"
                )
            self.referenced_library.setdefault(key, set()).add(ref["template"])
            return templates[ref["template"]]
        name = holder.get("template")
        if not name:
            self.fail(f"{path}: template or templateRef is required")
        if name not in scope:
            self.fail(f"{path}: template name '{name}' undefined")
        return scope[name]

    def reference(self, holder: dict, path: str, arguments: dict) -> None:
        template = self.target(holder, path)
        supplied = {p.get("name") for p in (arguments or {}).get("parameters") or []}
        for param in (template.get("inputs") or {}).get("parameters") or []:
            has_value = "value" in param or "default" in param or "default" in (param.get("valueFrom") or {})
            if not has_value and param.get("name") not in supplied:
                self.fail(f"{path}: inputs.parameters.{param.get('name')} was not supplied")

    def hook(self, name: str, hook: dict, path: str) -> None:
        if name != "exit":
            raise MoerlError(
                f"unsupported: hooks.{name} at {path}: only the exit hook is run here; use onExit or hooks.exit"
            )
        self.reference(hook, f"{path}.exit", hook.get("arguments") or {})

    def positive_int(self, value: Any, path: str) -> None:
        if isinstance(value, str) and "{{" in value:
            return
        try:
            ok = int(value) >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            self.fail(f"{path} must be a non-negative integer, got {value!r}")

    def expression(self, source: str, path: str) -> None:
        """Syntax and function names of an expr-lang expression (tags still in it are placeholders)."""
        text = re.sub(r"\{\{[^}]*\}\}", "x", source)
        try:
            called = exprlang.called_functions(text)
        except exprlang.ExprError as err:
            self.fail(f"{path}: {err}")
        for function in called:
            if function.startswith("sprig.") and function[6:] not in SPRIG:
                raise MoerlError(f"unsupported: {function} at {path}: this sprig function is not implemented")
            if (
                not function.startswith("sprig.")
                and function not in BUILTINS
                and function not in ("all", "any", "none", "one", "filter", "map", "count", "find", "findIndex")
            ):
                raise MoerlError(f"unsupported: {function}() at {path}: this expr-lang function is not implemented")

    def tags(self, value: Any, path: str) -> None:
        """Every `{{= ...}}` tag in a template must parse."""
        if isinstance(value, str):
            for tag in re.findall(r"\{\{=(.*?)\}\}", value, re.DOTALL):
                self.expression(tag, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                self.tags(item, f"{path}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                self.tags(item, f"{path}[{i}]")

    def retry_strategy(self, retry: dict, path: str) -> None:
        policy = retry.get("retryPolicy")
        if policy and policy not in RETRY_POLICIES:
            self.fail(f"{path}.retryPolicy {policy!r} is not one of {', '.join(RETRY_POLICIES)}")
        if retry.get("limit") is not None and "{{" not in str(retry["limit"]):
            self.positive_int(retry["limit"], f"{path}.limit")
        if retry.get("expression"):
            self.expression(retry["expression"], f"{path}.expression")
        backoff = retry.get("backoff") or {}
        for key in ("duration", "maxDuration", "cap"):
            if backoff.get(key) is not None and "{{" not in str(backoff[key]):
                try:
                    parse_duration(backoff[key])
                except ValueError as err:
                    self.fail(f"{path}.backoff.{key}: {err}")
        if backoff and not backoff.get("duration"):
            self.fail(f"{path}.backoff.duration is required (no base duration specified for retryStrategy)")

    def template(self, template: dict, path: str) -> None:
        name = template.get("name")
        path = f"{path} ({name!r})"
        if self.spec.get("templateDefaults"):  # what runs is the template over the defaults (an image, a command)
            template = merge_defaults(self.spec["templateDefaults"], template)
        types = [t for t in TEMPLATE_TYPES if t in template]
        if len(types) != 1:
            how = "unspecified" if not types else "multiple template types specified"
            self.fail(
                f"templates.{name} template type {how}. choose one of: container, steps, script, resource, dag, suspend"
            )
        kind = types[0]
        if template.get("activeDeadlineSeconds") is not None:
            if kind not in LEAF_TYPES:
                self.fail(f"templates.{name}.activeDeadlineSeconds is only valid for leaf templates")
            self.positive_int(template["activeDeadlineSeconds"], f"{path}.activeDeadlineSeconds")
        for key in ("timeout", "pendingTimeout"):
            if template.get(key) and "{{" not in str(template[key]):
                try:
                    parse_duration(template[key])
                except ValueError as err:
                    self.fail(f"templates.{name}.{key}: {err}")
        if template.get("parallelism") is not None and kind not in ("steps", "dag"):
            self.fail(f"templates.{name}.parallelism is only valid for steps and dag templates")
        if template.get("retryStrategy") is not None:
            self.retry_strategy(template["retryStrategy"], f"{path}.retryStrategy")
        if kind in ("container", "script") and not (template[kind] or {}).get("image"):
            self.fail(f"templates.{name}.{kind}.image may not be empty")
        if kind in ("container", "script"):
            self.command(template[kind] or {}, f"{path}.{kind}")
        if kind == "suspend" and not (template["suspend"] or {}).get("duration"):
            raise MoerlError(
                f"unsupported: suspend without duration at {path}: it waits for `argo resume`; give suspend.duration"
            )
        if kind == "resource":
            self.resource(template["resource"] or {}, f"{path}.resource")
        for i, param in enumerate((template.get("outputs") or {}).get("parameters") or []):
            ref = f"templates.{name}.outputs.parameters.{param.get('name')}"
            if param.get("valueFrom") is not None and param.get("value") is not None:
                self.fail(f"{ref} has both valueFrom and value specified, choose one")
            if param.get("valueFrom") is None:  # a literal `value` is the output (validateOutputParameter)
                if param.get("value") is None:
                    self.fail(f"{ref} does not have valueFrom or value specified")
                continue
            source = param["valueFrom"]
            if kind in ("container", "script") and not source.get("path"):
                self.fail(f"{path}.outputs.parameters[{i}].valueFrom.path must be specified for {kind} templates")
            if kind in ("steps", "dag") and not (source.get("parameter") or source.get("expression")):
                self.fail(
                    f"{path}.outputs.parameters[{i}].valueFrom.parameter or expression must be specified "
                    f"for {kind} templates"
                )
        for i, volume in enumerate(template.get("volumes") or []):
            self.volume(volume, f"{path}.volumes[{i}]")
        self.tags(template, path)
        if kind == "steps":
            self.steps(template, path)
        if kind == "dag":
            self.dag(template, path)

    def command(self, container: dict, path: str) -> None:
        """A container without `command` runs its image's ENTRYPOINT, which only the image knows."""
        image = str(container.get("image") or "")
        if container.get("command") or image in self.entrypoints:
            return
        raise MoerlError(
            f"unsupported: container without command at {path}: image {image!r} would run its own ENTRYPOINT, "
            f"which is not known here; give command, or map the image to a host command with "
            f"`moerl local --entrypoint '{image}=COMMAND'`"
        )

    def volume(self, volume: dict, path: str) -> None:
        if not volume.get("name"):
            self.fail(f"{path}.name is required")

    def resource(self, resource: dict, path: str) -> None:
        if resource.get("action") != "create":
            raise MoerlError(
                f"unsupported: resource.action {resource.get('action')!r} at {path}: only `create` "
                f"of a kubeflow.org/v1 PyTorchJob is run here"
            )
        text = re.sub(r"\{\{[^}]*\}\}", "x", str(resource.get("manifest") or ""))
        try:
            body = yaml.safe_load(text)
        except yaml.YAMLError:
            self.fail(f"{path}.manifest must be a valid yaml")
        if (
            not isinstance(body, dict)
            or body.get("kind") != "PyTorchJob"
            or not str(body.get("apiVersion", "")).startswith("kubeflow.org/")
        ):
            kind = body.get("kind") if isinstance(body, dict) else None
            raise MoerlError(
                f"unsupported: resource kind {kind!r} at {path}.manifest: only a kubeflow.org/v1 "
                f"PyTorchJob is run here (as torchrun)"
            )
        if not resource.get("successCondition") and not resource.get("failureCondition"):
            raise MoerlError(
                f"unsupported: resource without successCondition at {path}: Argo would not wait for "
                f"the PyTorchJob; add successCondition: status.replicaStatuses.Master.succeeded > 0 "
                f"and failureCondition: status.replicaStatuses.Master.failed > 0"
            )
        specs = (body.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        if "Master" not in specs:
            self.fail(f"{path}.manifest: spec.pytorchReplicaSpecs.Master is required")
        for role, replica in specs.items():
            if role not in ("Master", "Worker"):
                raise MoerlError(f"unsupported: replica type {role} at {path}.manifest: only Master and Worker")
            containers = (((replica or {}).get("template") or {}).get("spec") or {}).get("containers") or []
            if len(containers) != 1:
                raise MoerlError(
                    f"unsupported: {len(containers)} containers in the {role} replica at "
                    f"{path}.manifest: exactly one (the trainer) is run"
                )
            check_fields(containers[0], "Container", f"{path}.manifest.{role}.containers[0]")
            self.command(containers[0], f"{path}.manifest.{role}.containers[0]")

    def call(self, step: dict, path: str) -> None:
        self.reference(step, path, step.get("arguments") or {})
        if step.get("onExit"):
            self.reference({"template": step["onExit"]}, f"{path}.onExit", {})
        for hook_name, hook in (step.get("hooks") or {}).items():
            self.hook(hook_name, hook, f"{path}.hooks")
        if step.get("withSequence"):
            sequence = step["withSequence"]
            if sequence.get("end") is None and sequence.get("count") is None:
                self.fail(f"{path}.withSequence: neither end nor count was specified")
        if sum(1 for k in ("withItems", "withParam", "withSequence") if step.get(k) not in (None, [], "")) > 1:
            self.fail(f"{path}: only one of withItems, withParam or withSequence can be specified")

    def steps(self, template: dict, path: str) -> None:
        for i, group in enumerate(template["steps"] or []):
            names = set()
            for j, step in enumerate(group or []):
                step_path = f"{path}.steps[{i}][{j}]"
                if not step.get("name"):
                    self.fail(f"{step_path}.name is required")
                if step["name"] in names:
                    self.fail(f"templates.{template['name']}.steps[{i}].name '{step['name']}' is not unique")
                names.add(step["name"])
                self.call(step, f"{step_path} ({step['name']!r})")

    def dag(self, template: dict, path: str) -> None:
        tasks = (template["dag"] or {}).get("tasks") or []
        if not tasks:
            self.fail(f"templates.{template['name']} must have at least one task")
        by_name: dict[str, dict] = {}
        for i, task in enumerate(tasks):
            if not task.get("name"):
                self.fail(f"{path}.dag.tasks[{i}].name is required")
            if task["name"] in by_name:
                self.fail(f"templates.{template['name']}.tasks[{i}].name '{task['name']}' is not unique")
            by_name[task["name"]] = task
        uses_depends = any(t.get("depends") for t in tasks)
        if uses_depends and any(t.get("dependencies") for t in tasks):
            self.fail(
                f"templates.{template['name']} cannot use both 'depends' and 'dependencies' in the same DAG template"
            )
        if uses_depends and any(t.get("continueOn") for t in tasks):
            self.fail(
                f"templates.{template['name']} cannot use 'continueOn' when using 'depends'. Instead use "
                f"'dep-task.Failed'/'dep-task.Errored'"
            )
        graph = {}
        for i, task in enumerate(tasks):
            task_path = f"{path}.dag.tasks[{i}] ({task['name']!r})"
            try:
                deps, logic = task_dependencies(task, by_name)
            except ValueError as err:
                self.fail(f"templates.{template['name']}.tasks.{task['name']} {err}")
            if logic:
                self.expression(logic.replace("-", "_"), f"{task_path}.depends")
            graph[task["name"]] = deps
            self.call(task, task_path)
        for target in str((template["dag"] or {}).get("target") or "").split():
            if target not in by_name and "{{" not in target:
                self.fail(f"templates.{template['name']}.targets: target '{target}' is not defined")
        _check_acyclic(graph, template["name"], self.fail)


def _check_acyclic(graph: dict[str, list[str]], template_name: str, fail: Any) -> None:
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            fail(f"templates.{template_name} sorting failed: dependency cycle {' -> '.join(trail + [name])}")
        state[name] = 1
        for dep in graph.get(name, []):
            visit(dep, trail + [name])
        state[name] = 2

    for name in graph:
        visit(name, [])
