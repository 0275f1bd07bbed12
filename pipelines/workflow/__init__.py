"""Hera builders of the run's Argo objects (see build.py), and the shape of a run (graph.py)."""

from pipelines.workflow.build import (
    ArgoObjects,
    argo_objects,
    cron_workflow,
    template_name,
    workflow,
    workflow_from_template,
    workflow_templates,
)

__all__ = [
    "ArgoObjects",
    "argo_objects",
    "cron_workflow",
    "template_name",
    "workflow",
    "workflow_from_template",
    "workflow_templates",
]
