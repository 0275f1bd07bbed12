"""The Argo templates of one run: one per step, shared by every iteration, plus the DAG that unrolls them.

Steps get everything else from <run>/run.json, so a template passes only the run store, the iteration, the
shard and the policy version. Each container's pod carries the run, step and iteration as labels, and runs
as the images' non-root user with a read-only root filesystem and /tmp as an emptyDir (placement.py): the
outputs Argo reads back (/tmp/plan, /tmp/metrics.json, /tmp/report) are on that volume, which is where Argo's
executor can read them under a security context.
"""

from __future__ import annotations

import json

import yaml
from hera.workflows import DAG, Artifact, Container, NoneArchiveStrategy, Parameter, Resource, Task
from hera.workflows.models import (
    EnvVar,
    Gauge,
    MetricLabel,
    Metrics,
    PodSecurityContext,
    Prometheus,
    ResourceRequirements,
    SecurityContext,
    Sequence,
    Toleration,
    ValueFrom,
    Volume,
    VolumeMount,
)

from pipelines.config import RunConfig
from pipelines.workflow import graph, pytorchjob
from pipelines.workflow import placement as pl
from pipelines.workflow.retry import retry_for

ITERATION = "{{inputs.parameters.iteration}}"
PLAN_OUT = "/tmp/plan"
# The score step writes its metrics JSON here; the workflow reads it back as an output parameter.
SCORE_METRICS_PATH = "/tmp/metrics.json"
SCORE_METRIC_KEYS = {"reward_mean": "moerl_reward_mean", "accuracy": "moerl_accuracy"}
REPORT_OUT = "/tmp/report"
MAIN = "main"


def flags(**values: object) -> list[str]:
    """--name value pairs, in order; underscores in names become dashes."""
    return [item for name, value in values.items() for item in (f"--{name.replace('_', '-')}", str(value))]


def _step_container(
    cfg: RunConfig,
    name: str,
    role: str,
    image: str,
    command: list[str],
    args: list[str],
    *,
    inputs: list[Parameter] | None = None,
    iteration: str | None = None,
    **extra: object,
) -> Container:
    """A container template placed, labelled and retried as its role says."""
    p = cfg.placement[role]
    res = pl.resources(p)
    return Container(
        name=name,
        image=image,
        command=command,
        args=args,
        inputs=inputs,
        env=extra.pop("env", None) or [EnvVar(**e) for e in pl.env()],
        resources=ResourceRequirements(**res) if res else None,
        node_selector=pl.node_selector(cfg, role) or None,
        tolerations=[Toleration(**t) for t in pl.tolerations(p)] or None,
        priority_class_name=p.priority_class,
        retry_strategy=retry_for(cfg.retries[role], p.spot),
        labels=pl.labels(cfg, name, iteration),
        annotations=pl.annotations(role) or None,
        volumes=[Volume.model_validate(v) for v in pl.volumes(p)],
        volume_mounts=[VolumeMount.model_validate(m) for m in pl.volume_mounts(p)],
        pod_security_context=PodSecurityContext.model_validate(pl.pod_security_context()),
        security_context=SecurityContext.model_validate(pl.container_security_context()),
        **extra,
    )


def _tracked_env(cfg: RunConfig) -> list[EnvVar]:
    """Every step's env, plus the trackers' credentials (secretKeyRefs) for the steps that log to them."""
    return [EnvVar.model_validate(e) for e in pl.env() + pl.tracking_env(cfg)]


def _iteration_step(
    cfg: RunConfig, name: str, role: str, image: str, command: list[str], args: list[str], **extra: object
) -> Container:
    """A step that runs once per iteration: the iteration is its one input, and a label of its pod."""
    inputs = [Parameter(name="iteration")]
    return _step_container(cfg, name, role, image, command, args, inputs=inputs, iteration=ITERATION, **extra)


def config_json(cfg: RunConfig) -> str:
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def python_step(module: str) -> list[str]:
    return ["python", "-m", module]


def plan_template(cfg: RunConfig, segment: graph.Segment) -> Container:
    args = flags(
        run=cfg.run_store, first=segment.first, last=segment.last, out=PLAN_OUT, run_config_json=config_json(cfg)
    )
    latest = Parameter(name="latest", value_from=ValueFrom(path=f"{PLAN_OUT}/latest"))
    return _step_container(
        cfg, graph.PLAN, "control", cfg.images.cpu, python_step("steps.plan"), args, outputs=[latest]
    )


def import_sft_template(cfg: RunConfig) -> Container:
    args = flags(src=cfg.sft_checkpoint, run=cfg.run_store, run_config_json=config_json(cfg))
    return _step_container(cfg, graph.IMPORT_SFT, "control", cfg.images.cpu, python_step("steps.import_sft"), args)


def rollout_template(cfg: RunConfig) -> Container:
    args = flags(
        run=cfg.run_store,
        iteration=ITERATION,
        shard="{{inputs.parameters.shard}}",
        num_shards=cfg.rollout.num_shards,
        policy_version="{{inputs.parameters.policy-version}}",
    )
    inputs = [Parameter(name="iteration"), Parameter(name="shard"), Parameter(name="policy-version")]
    return _step_container(
        cfg,
        "rollout",
        "rollout",
        cfg.images.rollout,
        python_step("steps.rollout"),
        args,
        inputs=inputs,
        iteration=ITERATION,
    )


def score_metrics(cfg: RunConfig) -> Metrics:
    """Prometheus gauges per iteration, read from the score step's metrics JSON once it succeeded."""
    labels = [MetricLabel(key="run", value=cfg.name), MetricLabel(key="iteration", value=ITERATION)]
    return Metrics(
        prometheus=[
            Prometheus(
                name=metric,
                help=f"{key} of the iteration, from the score step",
                labels=labels,
                when="{{status}} == Succeeded",
                gauge=Gauge(realtime=False, value=f"{{{{=jsonpath(outputs.parameters.metrics, '$.{key}')}}}}"),
            )
            for key, metric in SCORE_METRIC_KEYS.items()
        ]
    )


def score_template(cfg: RunConfig) -> Container:
    args = flags(run=cfg.run_store, iteration=ITERATION, metrics_out=SCORE_METRICS_PATH)
    # The metrics feed only the Prometheus gauges (the store has them too): a missing file is no failure.
    metrics_json = Parameter(name="metrics", value_from=ValueFrom(path=SCORE_METRICS_PATH, default="{}"))
    return _iteration_step(
        cfg,
        "score",
        "score",
        cfg.images.cpu,
        python_step("steps.score"),
        args,
        outputs=[metrics_json],
        metrics=score_metrics(cfg),
        env=_tracked_env(cfg),
    )


def update_template(cfg: RunConfig) -> Container | Resource:
    """torchrun in one pod, or a PyTorchJob over trainer.nodes nodes that Argo creates and waits on."""
    if cfg.trainer.nodes == 1:
        args = pytorchjob.torchrun_args(cfg, ITERATION)
        return _iteration_step(cfg, "update", "trainer", cfg.images.trainer, ["torchrun"], args, env=_tracked_env(cfg))
    return Resource(
        name="update",
        action="create",
        set_owner_reference=True,  # the job goes when the Workflow goes
        manifest=pytorchjob.manifest_yaml(cfg, ITERATION),
        success_condition=pytorchjob.SUCCESS_CONDITION,
        failure_condition=pytorchjob.FAILURE_CONDITION,
        inputs=[Parameter(name="iteration")],
        retry_strategy=retry_for(cfg.retries["trainer"], spot=False),
        labels=pl.labels(cfg, "update", ITERATION),
    )


def publish_template(cfg: RunConfig) -> Container:
    args = flags(run=cfg.run_store, iteration=ITERATION)
    return _iteration_step(cfg, "publish", "control", cfg.images.cpu, python_step("steps.publish"), args)


def report_template(cfg: RunConfig) -> Container:
    """The exit handler: metrics table, report.md and the reward/accuracy PNG, whatever the outcome."""
    args = flags(
        run=cfg.run_store,
        out=REPORT_OUT,
        status="{{workflow.status}}",
        workflow_name="{{workflow.name}}",  # the trackers' tag and link, and whose step times to read
        namespace="{{workflow.namespace}}",
    )
    # Unarchived, so that the Argo UI shows the PNG itself.
    png = Artifact(name="report-png", path=f"{REPORT_OUT}/report.png", archive=NoneArchiveStrategy())
    outputs = [png] if cfg.argo.report_artifact else None
    return _step_container(
        cfg, graph.REPORT, "control", cfg.images.cpu, python_step("steps.report"), args, outputs=outputs,
        env=_tracked_env(cfg),
    )  # fmt: skip


def next_segment_template(cfg: RunConfig, next_template: str, segment_index: int) -> Resource:
    """Submit the next segment's Workflow; the run's mutex holds it until this one has finished."""
    workflow = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "generateName": f"{cfg.name}-",
            "labels": {pl.RUN_LABEL: cfg.name, pl.SEGMENT_LABEL: str(segment_index)},
        },
        "spec": {"workflowTemplateRef": {"name": next_template}},
    }
    return Resource(
        name=graph.NEXT_SEGMENT,
        action="create",
        manifest=yaml.safe_dump(workflow, sort_keys=False),
        retry_strategy=retry_for(cfg.retries["control"], False),
    )


def main_dag(cfg: RunConfig, segment: graph.Segment) -> DAG:
    """Unroll the segment's iterations. Tasks of iterations that LATEST already covers are skipped."""
    latest = f"{{{{tasks.{graph.PLAN}.outputs.parameters.latest}}}}"
    tasks = []
    for name, deps in graph.dependencies(segment, cfg.staleness).items():
        step, _, number = name.rpartition("-")
        depends = " && ".join(deps) or None
        if step not in graph.STEPS:  # plan, import-sft (only before the first LATEST), next-segment
            when = f"{latest} < 0" if name == graph.IMPORT_SFT else None
            tasks.append(Task(name=name, template=name, depends=depends, when=when))
            continue
        i = int(number)
        arguments = {"iteration": str(i)}
        shards = None
        if step == "rollout":
            arguments |= {"shard": "{{item}}", "policy-version": str(graph.policy_version(i, cfg.staleness))}
            shards = Sequence(count=str(cfg.rollout.num_shards))
        tasks.append(
            Task(
                name=name,
                template=step,
                depends=depends,
                when=f"{latest} < {i}",
                arguments=arguments,
                with_sequence=shards,
            )
        )
    return DAG(name=MAIN, tasks=tasks)


def templates(cfg: RunConfig, segment: graph.Segment, next_template: str | None) -> list:
    out = [main_dag(cfg, segment), plan_template(cfg, segment)]
    if segment.is_first:
        out.append(import_sft_template(cfg))
    out += [
        rollout_template(cfg),
        score_template(cfg),
        update_template(cfg),
        publish_template(cfg),
        report_template(cfg),
    ]
    if next_template is not None:
        out.append(next_segment_template(cfg, next_template, segment.index + 1))
    return out
