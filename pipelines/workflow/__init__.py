"""Hera builders of the run's Argo objects (see build.py), and the shape of a run (graph.py).

The builders load on first use (PEP 562): build.py imports Hera, about a second, which the placement and
graph modules do not need and which `moerl demo` spends after its warm server has started (pipelines/demo.py).
"""

from typing import Any

__all__ = [
    "ArgoObjects",
    "argo_objects",
    "cron_workflow",
    "template_name",
    "workflow",
    "workflow_from_template",
    "workflow_templates",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from pipelines.workflow import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
