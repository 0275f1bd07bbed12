"""How a step, a DAG task, a hook or the entrypoint calls a template, and what travels with the call."""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.local.api.status import ERROR, FAILED


@dataclass
class Call:
    """A reference to a template: from a step, a DAG task, a hook or the entrypoint."""

    holder: dict  # as written: template or templateRef, arguments, name, when, ...
    kind: str  # "step", "task", "hook" or "root"
    scope: tuple[bool, str] | None = None  # the WorkflowTemplate the caller is in; None: the workflow


@dataclass
class Opts:
    """Where the node of a call goes, and what applies to it."""

    boundary_id: str = ""  # the steps/DAG node it belongs to (Argo's boundaryID)
    display_parent: str | None = None  # the node the view nests it under
    on_exit: bool = False  # part of an exit handler: exempt from the workflow's deadline and chaos
    hooked: bool = False
    retried: bool = False
    execution_deadline: float | None = None  # backoff.maxDuration, applied to the pods of attempts


class TemplateError(Exception):
    """A template that cannot be executed; its node becomes an Error with this message."""


def exit_hook_of(holder: dict) -> dict | None:
    """A step's, task's or workflow's exit handler: hooks.exit, else onExit."""
    hooks = holder.get("hooks") or {}
    if "exit" in hooks:
        return hooks["exit"]
    if holder.get("onExit"):
        return {"template": holder["onExit"]}
    return None


def continues_on(holder: dict | None, phase: str) -> bool:
    """continueOn: a Failed or Errored step or task that does not fail its group or DAG."""
    continue_on = (holder or {}).get("continueOn") or {}
    return (phase == ERROR and bool(continue_on.get("error"))) or (phase == FAILED and bool(continue_on.get("failed")))
