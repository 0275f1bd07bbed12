"""DAG `depends` logic, as Argo's workflow/common/ancestry.go and dag.go evaluate it.

`depends: "A && (B.Failed || C.Skipped)"` names tasks with an optional result; a bare task name
means `(A.Succeeded || A.Skipped || A.Daemoned)`, plus `A.Errored`/`A.Failed` when A has
continueOn error/failed. `dependencies: [A, B]` is the old spelling of `depends: "A && B"`. The
expression is evaluated with expr-lang over each dependency's results, dashes in task names turned
into underscores (`my-task.Succeeded` -> `my_task.Succeeded`).
"""

from __future__ import annotations

import re
from typing import Any

from pipelines.local.api.status import ERROR, FAILED, OMITTED, SKIPPED_PHASE, SUCCEEDED
from pipelines.local.lang import exprlang

TASK_NAME_RE = re.compile(r"([a-zA-Z0-9][-a-zA-Z0-9]*?\.[A-Z][a-zA-Z]+)|([a-zA-Z0-9][-a-zA-Z0-9]*)")
RESULTS = ("Succeeded", "Failed", "Errored", "Skipped", "Omitted", "Daemoned", "AnySucceeded", "AllFailed")


def expand_dependency(name: str, task: dict) -> str:
    results = [f"{name}.Succeeded", f"{name}.Skipped", f"{name}.Daemoned"]
    continue_on = task.get("continueOn") or {}
    if continue_on.get("error"):
        results.append(f"{name}.Errored")
    if continue_on.get("failed"):
        results.append(f"{name}.Failed")
    return "(" + " || ".join(results) + ")"


def task_dependencies(task: dict, tasks: dict[str, dict]) -> tuple[list[str], str]:
    """(names of the tasks `task` waits for, its depends expression with every bare name expanded).
    Raises ValueError for a dependency that is not a task or a result that does not exist."""
    depends = task.get("depends") or ""
    if not depends:
        for dep in task.get("dependencies") or []:
            if dep not in tasks:
                raise ValueError(f"dependency '{dep}' not defined")
        depends = " && ".join(expand_dependency(dep, tasks[dep]) for dep in task.get("dependencies") or [])
    dependencies: list[str] = []
    pieces: list[str] = []
    pos = 0
    for match in TASK_NAME_RE.finditer(depends):
        with_result, bare = match.group(1), match.group(2)
        name = (with_result or bare).split(".")[0]
        if name in ("and", "or", "not", "true", "false"):
            continue
        if name not in tasks:
            raise ValueError(f"dependency '{name}' not defined")
        if with_result and with_result.split(".")[1] not in RESULTS:
            raise ValueError(f"task result '{with_result.split('.')[1]}' for task '{name}' is invalid")
        if name not in dependencies:
            dependencies.append(name)
        if bare:
            pieces.append(depends[pos : match.start()])
            pieces.append(expand_dependency(name, tasks[name]))
            pos = match.end()
    pieces.append(depends[pos:])
    return dependencies, "".join(pieces)


def task_results(phase: str, child_phases: list[str] | None, daemoned: bool = False) -> dict[str, bool]:
    """Argo's TaskResults of one dependency; child_phases is given for an expanded task (TaskGroup); daemoned:
    a daemon that is running and ready (Argo: IsDaemoned() && phase != Pending)."""
    any_succeeded = any(p == SUCCEEDED for p in child_phases or [])
    all_failed = bool(child_phases) and all(p == FAILED for p in child_phases or [])
    return {
        "Succeeded": phase == SUCCEEDED,
        "Failed": phase == FAILED,
        "Errored": phase == ERROR,
        "Skipped": phase == SKIPPED_PHASE,
        "Omitted": phase == OMITTED,
        "Daemoned": daemoned,
        "AnySucceeded": any_succeeded,
        "AllFailed": all_failed,
    }


def evaluate_depends(logic: str, results: dict[str, dict[str, Any]]) -> bool:
    """Whether a task whose dependencies all finished with `results` should run."""
    env = {name.replace("-", "_"): value for name, value in results.items()}
    try:
        return exprlang.evaluate_bool(logic.replace("-", "_"), env)
    except exprlang.ExprError as err:
        raise ValueError(f"unable to evaluate expression '{logic.replace('-', '_')}': {err}") from err
