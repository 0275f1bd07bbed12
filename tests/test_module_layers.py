"""The import layers: a step module never imports another step module (what two steps share is a library).
A step module is one that the workflow runs as `python -m steps.<name>`: its `__main__` block calls run_cli."""

from __future__ import annotations

import ast
from pathlib import Path

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


def test_no_import_cycle_among_the_steps_libraries():
    """Counting lazy imports: the engines import the generation interface, never each other or back."""
    graph = {f"steps.{p.stem}": {m for m in imported_modules(p) if m.startswith("steps.")} for p in STEPS.glob("*.py")}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for module in graph.get(start, ()):
            if module == target or (module not in seen and reaches(module, target, seen | {module})):
                return True
        return False

    assert not sorted(m for m in graph if reaches(m, m, {m}))
