"""The Argo objects of a run: WorkflowTemplates (one per segment), Workflows and the CronWorkflow.

    workflow_templates(cfg)      one WorkflowTemplate per segment of at most segment_size iterations
    workflow_from_template(cfg)  a Workflow that runs the run from its first segment's template
    workflow(cfg)                the whole run as one self-contained Workflow (what the local executor runs)
    cron_workflow(cfg)           a CronWorkflow that continues the run from LATEST on a schedule
    argo_objects(cfg, ...)       all of these, bound to a WorkflowsService, ready for .create()

Every Workflow starts by planning from LATEST, so submitting again, or the schedule firing, continues the run
where it stopped; a run's Workflows never run at once (a mutex per run), and a semaphore bounds how many
runs share the cluster.

In the Argo UI: the title and a Markdown description per Workflow, tasks named after step and iteration
(rollout-3, update-3), pods labelled with run, step and iteration, Argo's progress (finished pods of the
unrolled DAG; a step may refine its own by writing "done/total" to $ARGO_PROGRESS_FILE), Prometheus gauges
of reward mean and accuracy per iteration, and the report's PNG as an artifact of the exit handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hera.workflows import CronWorkflow, Workflow, WorkflowsService, WorkflowTemplate
from hera.workflows.models import (
    ConfigMapKeySelector,
    Mutex,
    PodGC,
    SemaphoreRef,
    Synchronization,
    TTLStrategy,
    WorkflowMetadata,
    WorkflowTemplateRef,
)

from pipelines.workflow import graph
from pipelines.workflow import placement as pl
from pipelines.workflow import templates as tpl
from steps.run.config import RunConfig
from steps.store.object_store import Store
from steps.tracking.trackers import wandb_run_id

TITLE = "workflows.argoproj.io/title"
DESCRIPTION = "workflows.argoproj.io/description"


def template_name(cfg: RunConfig, index: int) -> str:
    """The WorkflowTemplate of segment `index`: the run name itself when the run is one segment."""
    if len(graph.segments(cfg.iterations, cfg.segment_size)) == 1:
        return cfg.name
    return f"{cfg.name}-seg-{index:03d}"


def _labels(cfg: RunConfig, segment: graph.Segment | None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "moerl", pl.RUN_LABEL: cfg.name, **cfg.argo.labels}
    if segment is not None and segment.count > 1:
        out[pl.SEGMENT_LABEL] = str(segment.index)
    return out


def _annotations(cfg: RunConfig, segment: graph.Segment) -> dict[str, str]:
    """What the Argo UI shows in the workflow list: a title, and a Markdown description."""
    t = cfg.trainer
    where = f"segment {segment.index + 1}/{segment.count}, " if segment.count > 1 else ""
    task = cfg.task.name if cfg.task is not None else f"prompts from `{cfg.prompt_file}`"
    description = (
        f"GRPO on {task}: {where}iterations {segment.first}-{segment.last} of {cfg.iterations}, "
        f"{cfg.prompts_per_iteration} prompts x {cfg.group_size} samples, staleness {cfg.staleness}. "
        f"Rollout: {cfg.rollout.num_shards} shards ({cfg.rollout.engine}). "
        f"Update: {t.nodes}x{t.nproc_per_node} ranks, expert parallel over {t.ep_backend}. "
        f"Store: `{cfg.run_store}`."
    ) + _tracking_description(cfg)
    return {TITLE: f"moerl {cfg.name}: RL iterations {segment.first}-{segment.last}", DESCRIPTION: description}


def _tracking_description(cfg: RunConfig) -> str:
    """Where the run's trackers are, for the Argo UI (the trackers get the Workflow's link as a tag)."""
    t = cfg.tracking
    where = []
    if t.tensorboard is not None and t.tensorboard.enabled:
        where.append(f"TensorBoard `tensorboard --logdir {cfg.run_store}/tensorboard`")
    if t.mlflow is not None:
        server = f" at {t.mlflow.tracking_uri}" if t.mlflow.tracking_uri else ""
        where.append(f"MLflow experiment `{t.mlflow.experiment}`{server}, run `{cfg.name}`")
    if t.wandb is not None:
        run_id = wandb_run_id(Store.open(cfg.run_store).uri)
        if t.wandb.entity and t.wandb.mode == "online":
            app = (t.wandb.base_url or "https://wandb.ai").rstrip("/")
            where.append(f"W&B [{t.wandb.project}/{run_id}]({app}/{t.wandb.entity}/{t.wandb.project}/runs/{run_id})")
        else:
            where.append(f"W&B project `{t.wandb.project}`, run `{run_id}`")
    return f" Tracking: {'; '.join(where)}." if where else ""


def _spec(cfg: RunConfig, segment: graph.Segment, next_template: str | None) -> dict[str, Any]:
    """The fields every Workflow of the run shares."""
    a = cfg.argo
    semaphores, mutexes = None, None
    if a.semaphore is not None:  # bounds how many moerl runs share the cluster
        semaphores = [SemaphoreRef(config_map_key_ref=ConfigMapKeySelector(name=a.semaphore.config_map,
                                                                           key=a.semaphore.key))]  # fmt: skip
    if a.run_mutex:  # two Workflows of one run (a submit and the schedule) would both write LATEST
        mutexes = [Mutex(name=f"moerl-run-{cfg.name}")]
    sync = Synchronization(semaphores=semaphores, mutexes=mutexes) if semaphores or mutexes else None
    return {
        "entrypoint": tpl.MAIN,
        "on_exit": graph.REPORT,
        "templates": tpl.templates(cfg, segment, next_template),
        "service_account_name": cfg.service_account,
        "pod_gc": PodGC(strategy=a.pod_gc, delete_delay_duration=a.pod_gc_delay),
        "ttl_strategy": TTLStrategy(
            seconds_after_success=a.ttl_seconds_after_success, seconds_after_failure=a.ttl_seconds_after_failure
        ),
        "synchronization": sync,
        "active_deadline_seconds": a.active_deadline_seconds,
    }


def workflow_templates(cfg: RunConfig) -> list[WorkflowTemplate]:
    segs = graph.segments(cfg.iterations, cfg.segment_size)
    out = []
    for seg in segs:
        next_template = None if seg.is_last else template_name(cfg, seg.index + 1)
        out.append(
            WorkflowTemplate(
                name=template_name(cfg, seg.index),
                namespace=cfg.namespace,
                labels=_labels(cfg, seg),
                annotations=_annotations(cfg, seg),
                # Workflows submitted from the template get the run's labels and the UI title.
                workflow_metadata=WorkflowMetadata(labels=_labels(cfg, seg), annotations=_annotations(cfg, seg)),
                **_spec(cfg, seg, next_template),
            )
        )
    return out


def workflow(cfg: RunConfig) -> Workflow:
    """The whole run in one self-contained Workflow (no template reference, no segments)."""
    seg = graph.whole_run(cfg.iterations)
    return Workflow(
        generate_name=f"{cfg.name}-",
        namespace=cfg.namespace,
        labels=_labels(cfg, None),
        annotations=_annotations(cfg, seg),
        **_spec(cfg, seg, None),
    )


def workflow_from_template(cfg: RunConfig) -> Workflow:
    """A Workflow that runs the first segment's template; it plans from LATEST and hands on to the next."""
    return Workflow(
        generate_name=f"{cfg.name}-",
        namespace=cfg.namespace,
        labels=_labels(cfg, None),
        workflow_template_ref=WorkflowTemplateRef(name=template_name(cfg, 0)),
    )


def cron_workflow(cfg: RunConfig, schedules: list[str] | None = None) -> CronWorkflow:
    """Continue the run on a schedule. Forbid: a start is skipped while the previous one, or any segment
    that it handed on to (templates.next_segment_templates makes them the cron's children), still runs."""
    s = cfg.schedule
    return CronWorkflow(
        name=tpl.cron_name(cfg),
        namespace=cfg.namespace,
        labels=_labels(cfg, None),
        annotations={
            TITLE: f"moerl {cfg.name}: continue from LATEST",
            DESCRIPTION: _annotations(cfg, graph.whole_run(cfg.iterations))[DESCRIPTION],
        },
        schedules=list(schedules or s.schedules),
        timezone=s.timezone,
        concurrency_policy="Forbid",
        starting_deadline_seconds=s.starting_deadline_seconds,
        cron_suspend=s.suspend or None,
        successful_jobs_history_limit=3,
        failed_jobs_history_limit=3,
        workflow_template_ref=WorkflowTemplateRef(name=template_name(cfg, 0)),
    )


@dataclass
class ArgoObjects:
    """Everything `moerl submit` and `moerl schedule` create, bound to one WorkflowsService."""

    templates: list[WorkflowTemplate]
    workflow: Workflow
    cron: CronWorkflow

    def create(self) -> Any:
        """Create or update the templates, then submit the Workflow; returns the submitted Workflow (to wait for
        the run, see wait.wait_for_run: Hera's own wait returns while the Workflow is still Pending)."""
        for template in self.templates:
            template.update()  # creates it when absent
        return self.workflow.create()

    def schedule(self) -> Any:
        """Create or update the templates, then the CronWorkflow; returns the CronWorkflow."""
        for template in self.templates:
            template.update()
        return self.cron.update()


def argo_objects(
    cfg: RunConfig,
    host: str | None = None,
    token: str | None = None,
    namespace: str | None = None,
    verify_ssl: bool = True,
    schedules: list[str] | None = None,
) -> ArgoObjects:
    """The run's Hera objects, bound to an Argo server, ready for `.create()`.

    The token goes only into the WorkflowsService (an Authorization header); it is never part of a manifest.
    """
    if namespace is not None:
        cfg = cfg.model_copy(update={"namespace": namespace})
    service = WorkflowsService(host=host, token=token, namespace=cfg.namespace, verify_ssl=verify_ssl)
    objects = ArgoObjects(workflow_templates(cfg), workflow_from_template(cfg), cron_workflow(cfg, schedules))
    for obj in (*objects.templates, objects.workflow, objects.cron):
        obj.workflows_service = service
    return objects
