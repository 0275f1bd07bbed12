"""The Argo objects of a run: its WorkflowTemplate (every segment), Workflows and the CronWorkflow.

    workflow_templates(cfg)      the run's one WorkflowTemplate: a segment of at most segment_size iterations
                                 from its parameter `first`, whatever the run's length
    workflow_from_template(cfg)  a Workflow that runs the run from its first segment (first=1)
    workflow(cfg)                the whole run as one self-contained Workflow (what the local executor runs)
    cron_workflow(cfg)           a CronWorkflow that continues the run from LATEST on a schedule
    argo_objects(cfg, ...)       all of these, bound to a WorkflowsService, ready for .create()

Every Workflow starts by planning from LATEST, so submitting again, or the schedule firing, continues the run
where it stopped; a run's Workflows never run at once (a mutex per run), and a semaphore bounds how many
runs share the cluster.

In the Argo UI: the title and a Markdown description per Workflow (a segment's with its iterations), tasks
named after step and position in the segment (rollout-3, update-3: the iteration itself in the first segment
and in the self-contained Workflow) with the iteration as their input parameter, pods labelled with run, step
and iteration, every segment's Workflow labelled with its index (moerl.io/segment), Argo's progress (finished
pods of the unrolled DAG; a step may refine its own by writing "done/total" to $ARGO_PROGRESS_FILE), Prometheus gauges
of reward mean and accuracy per iteration, and the report's PNG as an artifact of the exit handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hera.workflows import CronWorkflow, Parameter, Workflow, WorkflowsService, WorkflowTemplate
from hera.workflows.models import (
    ConfigMapKeySelector,
    LabelValueFrom,
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


def template_name(cfg: RunConfig) -> str:
    """The run's WorkflowTemplate, which every segment's Workflow runs: the run's name."""
    return cfg.name


def _labels(cfg: RunConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": "moerl", pl.RUN_LABEL: cfg.name, **cfg.argo.labels}


def _annotations(cfg: RunConfig, first: str, last: str, where: str = "") -> dict[str, str]:
    """What the Argo UI shows in the workflow list: a title, and a Markdown description (of iterations
    first-last, literal or Argo tags that a segment's Workflow resolves from its parameter)."""
    t = cfg.trainer
    task = cfg.task.name if cfg.task is not None else f"prompts from `{cfg.prompt_file}`"
    description = (
        f"GRPO on {task}: {where}iterations {first}-{last} of {cfg.iterations}, "
        f"{cfg.prompts_per_iteration} prompts x {cfg.group_size} samples, staleness {cfg.staleness}. "
        f"Rollout: {cfg.rollout.num_shards} shards ({cfg.rollout.engine}). "
        f"Update: {t.nodes}x{t.nproc_per_node} ranks, expert parallel over {t.ep_backend}. "
        f"Store: `{cfg.run_store}`."
    ) + _tracking_description(cfg)
    return {TITLE: f"moerl {cfg.name}: RL iterations {first}-{last}", DESCRIPTION: description}


def _whole_run_annotations(cfg: RunConfig) -> dict[str, str]:
    return _annotations(cfg, "1", str(cfg.iterations))


def _segment_metadata(cfg: RunConfig, shape: graph.Segment) -> WorkflowMetadata:
    """What a Workflow run from the segment template gets: the run's labels, its segment's index as the label
    moerl.io/segment (labelsFrom, from its `first`), and a title and description of its iterations (Argo
    substitutes the Workflow's parameters in workflowMetadata before it applies it)."""
    numbering = tpl.Numbering(shape, cfg.iterations, parameterized=True)
    several = shape.count > 1
    where = f"segment {{{{={numbering.segment_index()} + 1}}}}/{shape.count}, " if several else ""
    segment = {pl.SEGMENT_LABEL: LabelValueFrom(expression=f"string({numbering.segment_index()})")}
    return WorkflowMetadata(
        labels=_labels(cfg),
        labels_from=segment if several else None,
        annotations=_annotations(cfg, numbering.first(), numbering.last(), where),
    )


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


def _spec(
    cfg: RunConfig, segment: graph.Segment, next_template: str | None, parameterized: bool = False
) -> dict[str, Any]:
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
        "templates": tpl.templates(cfg, segment, next_template, parameterized),
        "service_account_name": cfg.service_account,
        "pod_gc": PodGC(strategy=a.pod_gc, delete_delay_duration=a.pod_gc_delay),
        "ttl_strategy": TTLStrategy(
            seconds_after_success=a.ttl_seconds_after_success, seconds_after_failure=a.ttl_seconds_after_failure
        ),
        "synchronization": sync,
        "active_deadline_seconds": a.active_deadline_seconds,
    }


def workflow_templates(cfg: RunConfig) -> list[WorkflowTemplate]:
    """The run's WorkflowTemplates: one, whatever the run's length. It runs one segment, from its parameter
    `first` (default 1) to min(first + segment_size - 1, iterations); every segment but the last ends by
    submitting a Workflow of the same template with `first` one segment on."""
    shape = graph.template_shape(cfg.iterations, cfg.segment_size)
    several = shape.count > 1
    first = Parameter(
        name=tpl.FIRST,
        value="1",
        description=f"the segment's first iteration: 1, {cfg.segment_size + 1}, ... (each segment's next-segment "
        "step gives the next one's)",
    )
    where = f"{shape.count} segments of up to {cfg.segment_size} (parameter `first`) over " if several else ""
    template = WorkflowTemplate(
        name=template_name(cfg),
        namespace=cfg.namespace,
        labels=_labels(cfg),
        annotations=_annotations(cfg, "1", str(cfg.iterations), where),
        # Workflows submitted from the template get the run's labels and the UI title of their segment.
        workflow_metadata=_segment_metadata(cfg, shape),
        arguments=[first],
        **_spec(cfg, shape, template_name(cfg) if several else None, parameterized=True),
    )
    return [template]


def workflow(cfg: RunConfig) -> Workflow:
    """The whole run in one self-contained Workflow (no template reference, no segments)."""
    seg = graph.whole_run(cfg.iterations)
    return Workflow(
        generate_name=f"{cfg.name}-",
        namespace=cfg.namespace,
        labels=_labels(cfg),
        annotations=_whole_run_annotations(cfg),
        **_spec(cfg, seg, None),
    )


def workflow_from_template(cfg: RunConfig) -> Workflow:
    """A Workflow that runs the template's first segment; it plans from LATEST and hands on to the next."""
    return Workflow(
        generate_name=f"{cfg.name}-",
        namespace=cfg.namespace,
        labels=_labels(cfg),
        workflow_template_ref=WorkflowTemplateRef(name=template_name(cfg)),
    )


def cron_workflow(cfg: RunConfig, schedules: list[str] | None = None) -> CronWorkflow:
    """Continue the run on a schedule. Forbid: a start is skipped while the previous one, or any segment
    that it handed on to (templates.next_segment_templates makes them the cron's children), still runs."""
    s = cfg.schedule
    return CronWorkflow(
        name=tpl.cron_name(cfg),
        namespace=cfg.namespace,
        labels=_labels(cfg),
        annotations={
            TITLE: f"moerl {cfg.name}: continue from LATEST",
            DESCRIPTION: _whole_run_annotations(cfg)[DESCRIPTION],
        },
        schedules=list(schedules or s.schedules),
        timezone=s.timezone,
        concurrency_policy="Forbid",
        starting_deadline_seconds=s.starting_deadline_seconds,
        cron_suspend=s.suspend or None,
        successful_jobs_history_limit=3,
        failed_jobs_history_limit=3,
        workflow_template_ref=WorkflowTemplateRef(name=template_name(cfg)),
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
