"""The import layers, read from every file under steps/ and pipelines/ (lazy and TYPE_CHECKING imports count).

steps/ holds the step commands (`python -m steps.<name>`: a module whose `__main__` block calls run_cli) and the
step process's contract (errors, progress) at its top, and the libraries in packages, each of which may import
only the packages its row of PACKAGE_RULES names (and the top's errors and progress). A command never imports
another command; nothing under steps/ imports pipelines/; no import cycle anywhere."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

STEPS = Path(__file__).resolve().parents[1] / "steps"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (lazy imports in functions count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from steps import update
    return found


def step_modules() -> set[str]:
    return {f"steps.{p.stem}" for p in STEPS.glob("*.py") if "\n    run_cli(main)" in p.read_text()}


def test_the_step_modules_are_found():
    assert {"steps.rollout", "steps.score", "steps.update", "steps.publish", "steps.plan"} <= step_modules()


def test_no_step_module_imports_another_step_module():
    steps = step_modules()
    offenders = {
        f"steps.{p.stem} imports {sorted((imported_modules(p) & steps) - {f'steps.{p.stem}'})}"
        for p in STEPS.glob("*.py")
        if (imported_modules(p) & steps) - {f"steps.{p.stem}"}
    }
    assert not offenders



def test_nothing_under_steps_imports_pipelines():
    """The pods need steps/ only; the run config's schema (run.json's) lives there too."""
    offenders = {p.name for p in STEPS.glob("*.py") if any(m.split(".")[0] == "pipelines" for m in imported_modules(p))}
    assert not offenders


@cache
def package_graph(root: str) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports (recursively over root's folders; TYPE_CHECKING and
    lazy imports count: a cycle through them is still two modules that cannot be read apart)."""
    base = STEPS.parent
    modules = {}
    for path in (base / root).rglob("*.py"):
        parts = path.relative_to(base).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(path):
            while imported and imported not in modules:  # `from a.b import c` names a.b.c or a.b
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every module that reaches itself, with one path that shows it."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for nxt in sorted(graph.get(module, ())):
                if nxt == start:
                    found.append(" -> ".join([*path, start]))
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def test_no_import_cycle_anywhere_in_pipelines():
    assert cycles(package_graph("pipelines")) == []


def test_no_import_cycle_anywhere_in_steps():
    assert cycles(package_graph("steps")) == []


def test_the_controller_is_the_host_the_walkers_are_written_against():
    """The walkers see the controller only through pipelines/local/controller/host.py's WalkerHost: every member it
    names is the controller's, with the same signature."""
    import inspect

    from pipelines.local.controller.host import WalkerHost
    from pipelines.local.controller.workflow_controller import Controller

    members = [name for name in vars(WalkerHost) if not name.startswith("_")]
    assert {"execute_template", "resolve", "settled", "outbound_nodes"} <= set(members)
    for name in members:
        if callable(vars(WalkerHost)[name]):
            assert inspect.signature(getattr(Controller, name)) == inspect.signature(getattr(WalkerHost, name)), name
    for attribute in WalkerHost.__annotations__:
        assert attribute in inspect.getsource(Controller.__init__), attribute


# package -> the packages of steps/ it may import (docs/architecture.md, "The libraries")
PACKAGE_RULES = {
    "store": set(),
    "data": {"store"},
    "run": {"store", "data"},
    "models": {"data"},
    "expert_parallel": {"models"},
    "engines": {"models", "data", "run", "store"},
    "environments": {"engines", "data"},
    "experience": {"engines", "environments", "data", "run", "store"},
    "scoring": {"engines", "environments", "experience", "data", "models", "run", "store"},
    "training": {"models", "expert_parallel", "experience", "run", "store", "tracking"},
    "tracking": {"run", "store"},
    "demo": {"models", "data", "engines", "environments"},
}
STEP_CONTRACT = {"steps.errors", "steps.progress"}
# The one module of experience/ the trainer reads: the rollout <-> training tables.
TRAINING_SEES_OF_EXPERIENCE = {"steps.experience.tables"}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGE_RULES else None


def test_every_library_is_in_a_package_with_a_rule():
    top = {p.stem for p in STEPS.glob("*.py")} - {"__init__"}
    assert top == {m.rpartition(".")[2] for m in step_modules()} | {"errors", "progress"}, "a library at the top"
    assert {p.name for p in STEPS.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(PACKAGE_RULES)


@pytest.mark.parametrize("package", sorted(PACKAGE_RULES))
def test_a_package_imports_only_what_its_rule_allows(package):
    graph = package_graph("steps")
    found = set()
    for module, targets in graph.items():
        if package_of(module) != package:
            continue
        for target in targets - STEP_CONTRACT - {"steps"}:
            other = package_of(target)
            if other is None:
                found.add(f"{module} imports {target} (a command or the top of steps/)")
            elif other != package and other not in PACKAGE_RULES[package]:
                found.add(f"{module} imports {target}")
            elif package == "training" and other == "experience" and target not in TRAINING_SEES_OF_EXPERIENCE:
                found.add(f"{module} imports {target} (training reads only {sorted(TRAINING_SEES_OF_EXPERIENCE)})")
    assert not sorted(found)


# pipelines/local/'s wings: wing -> the wings it may import (the front door, run.py, cli.py and view.py, any)
LOCAL_RULES = {"lang": set(), "api": {"lang"}, "pods": {"api", "lang"}, "controller": {"pods", "api", "lang"}}


def test_every_local_module_is_in_a_wing_or_the_front_door():
    local = STEPS.parent / "pipelines" / "local"
    assert {p.name for p in local.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LOCAL_RULES)
    assert {p.stem for p in local.glob("*.py")} == {"__init__", "run", "cli", "view"}


@pytest.mark.parametrize("wing", sorted(LOCAL_RULES))
def test_a_local_wing_imports_only_the_wings_below_it(wing):
    prefix = "pipelines.local."
    found = set()
    for module, targets in package_graph("pipelines").items():
        if not module.startswith(f"{prefix}{wing}"):
            continue
        for target in targets:
            if not target.startswith(prefix):
                continue
            other = target.removeprefix(prefix).split(".")[0]
            if other != wing and other not in LOCAL_RULES[wing]:
                found.add(f"{module} imports {target}")
    assert not sorted(found)


def test_no_file_over_800_lines_in_steps_or_pipelines():
    long = {
        str(p.relative_to(STEPS.parent)): n
        for root in ("steps", "pipelines")
        for p in (STEPS.parent / root).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert long == {}
