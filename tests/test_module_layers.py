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
    """The walkers see the controller only through pipelines/local/host.py's WalkerHost: every member it
    names is the controller's, with the same signature."""
    import inspect

    from pipelines.local.executor import Controller
    from pipelines.local.host import WalkerHost

    members = [name for name in vars(WalkerHost) if not name.startswith("_")]
    assert {"execute_template", "resolve", "settled", "outbound_nodes"} <= set(members)
    for name in members:
        if callable(vars(WalkerHost)[name]):
            assert inspect.signature(getattr(Controller, name)) == inspect.signature(getattr(WalkerHost, name)), name
    for attribute in WalkerHost.__annotations__:
        assert attribute in inspect.getsource(Controller.__init__), attribute
