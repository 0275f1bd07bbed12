"""The Argo templates of one run: one per step, shared by every iteration, plus the DAG that unrolls them.

One DAG serves every segment of a run: its tasks are named by their position in the segment (rollout-1 ..
rollout-S) and `Numbering` writes each task's iteration, a literal in the self-contained Workflow (the whole run,
where a position is its iteration) or, in the segment WorkflowTemplate, computed from the Workflow's `first`
parameter. Each task passes its iteration to its template, so the Argo UI shows it among the node's inputs,
and the pod carries it as the moerl.io/iteration label.

Each step's command line, role and image come from commands.py (as KFP's do); a template adds what Argo
makes of them. Each container's pod carries the run, step and iteration as labels, and runs as the images'
non-root user with a read-only root filesystem and /tmp as an emptyDir (placement.py): the outputs Argo
reads back (commands.PLAN_OUT, SCORE_METRICS_PATH, REPORT_OUT) are on that volume, which is where Argo's
executor can read them under a security context.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml
from hera.workflows import DAG, Artifact, Container, NoneArchiveStrategy, Parameter, Resource, Step, Steps, Task
from hera.workflows.models import (
    Affinity,
    EnvVar,
    ExecAction,
    Gauge,
    MetricLabel,
    Metrics,
    PodSecurityContext,
    Probe,
    Prometheus,
    ResourceRequirements,
    SecurityContext,
    Sequence,
    Toleration,
    ValueFrom,
    Volume,
    VolumeMount,
)

from pipelines.workflow import graph, pytorchjob
from pipelines.workflow import placement as pl
from pipelines.workflow.commands import (
    ARGO,
    PLAN_OUT,
    REPORT_OUT,
    SCORE_METRICS_PATH,
    StepCommand,
    pytorchjob_launcher_command,
    rollout_served,
    server_probe,
    step_command,
    trainer_served,
)
from pipelines.workflow.retry import retry_for
from pipelines.workflow.wait import PARENT_LABEL
from steps.progress import PROGRESS_ANNOTATION
from steps.pytorchjob_launcher import WAIT_DEADLINE_SECONDS
from steps.run.config import RunConfig
from steps.run.keys import TRAINER_SERVER_NAME, behaviour_version, rollout_server_name

ITERATION = ARGO.iteration
SCORE_METRIC_KEYS = {"reward_mean": "moerl_reward_mean", "accuracy": "moerl_accuracy"}
MAIN = "main"
CRON_LABEL = "workflows.argoproj.io/cron-workflow"  # what Argo's cron controller puts on its Workflows
TRAINER_SERVER = graph.TRAINER_SERVER
FIRST = "first"  # the segment WorkflowTemplate's parameter: the segment's first iteration
FIRST_VALUE = f"{{{{workflow.parameters.{FIRST}}}}}"


def _plus(k: int) -> str:
    return f" + {k}" if k > 0 else f" - {-k}" if k < 0 else ""


@dataclass(frozen=True)
class Numbering:
    """How the DAG of `segment` (positions 1..n) writes the iteration of the task at position i.

    Literal (`parameterized` False): the self-contained Workflow, the whole run, where position i is iteration i.
    Parameterized: the segment WorkflowTemplate, whose Workflows give their first iteration F as the parameter
    `first`; position i is iteration F + i - 1, and a position past the run's last iteration is skipped (its
    `when` is false: Argo marks it Skipped, which a bare name in `depends` accepts as it accepts Succeeded).
    Argument values use expression tags, `when` conditions govaluate's arithmetic (both Argo v4.1's and the
    local executor's)."""

    segment: graph.Segment
    iterations: int  # the run's
    parameterized: bool = False

    def _from_first(self, k: int) -> str:
        """F + k as an expression over the Workflow's parameter (no tag)."""
        return f"asInt(workflow.parameters.{FIRST}){_plus(k)}"

    def iteration(self, i: int) -> str:
        """The iteration of position i, as a parameter value."""
        if not self.parameterized:
            return str(i)
        return FIRST_VALUE if i == 1 else f"{{{{={self._from_first(i - 1)}}}}}"

    def policy_version(self, i: int, staleness: int) -> str:
        """The version that position i's rollout samples from (steps.run.keys.behaviour_version)."""
        if not self.parameterized:
            return str(behaviour_version(i, staleness))
        return f"{{{{=max({self._from_first(i - 2 - staleness)}, 0)}}}}"

    def _number(self, i: int) -> str:
        """The iteration of position i inside a `when` condition (govaluate)."""
        return str(i) if not self.parameterized else f"{FIRST_VALUE}{_plus(i - 1)}"

    def to_do(self, latest: str, i: int) -> str:
        """The `when` of position i's tasks: not yet published, and (parameterized) within the run."""
        if not self.parameterized:
            return f"{latest} < {i}"
        return f"{latest} < {self._number(i)} && {self._number(i)} <= {self.iterations}"

    def anything_to_do(self, latest: str) -> str:
        """The `when` of the segment's servers: some iteration of the segment is not yet published."""
        last = self.segment.last
        if not self.parameterized:
            return f"{latest} < {last}"
        return f"{latest} < {self._number(last)} && {latest} < {self.iterations}"

    def first(self) -> str:
        return str(self.segment.first) if not self.parameterized else FIRST_VALUE

    def last(self) -> str:
        """The segment's last iteration (plan's --last)."""
        if not self.parameterized:
            return str(self.segment.last)
        return f"{{{{=min({self._from_first(self.segment.last - 1)}, {self.iterations})}}}}"

    def has_next(self) -> str:
        """The `when` of next-segment: the segment ends before the run does."""
        return f"{self._number(self.segment.last)} < {self.iterations}"

    def next_first(self) -> str:
        """The next segment's first iteration, an expression tag."""
        return f"{{{{={self._from_first(len(self.segment.iterations))}}}}}"

    def segment_index(self) -> str:
        """The 0-based index of the segment as an expression (no tag): (F - 1) / segment_size."""
        return f"int(({self._from_first(-1)}) / {len(self.segment.iterations)})"


def _step_container(
    cfg: RunConfig,
    name: str,
    step: StepCommand,
    *,
    inputs: list[Parameter] | None = None,
    iteration: str | None = None,
    reports_progress: bool = False,
    retries: str | None = None,
    server: bool = False,
    **extra: object,
) -> Container:
    """A container template placed, labelled and retried as its role says; `reports_progress`: its step
    writes N/M to $ARGO_PROGRESS_FILE (steps/progress.py), and its pod starts at 0/1. `retries`: the role
    whose retry budget it spends when that is not its own: a client of a server, or the launcher of a
    server whose pods are that role's. `server`: a long-lived server's daemon (retried after any failure
    when on demand: retry.py)."""
    role = step.role
    p = cfg.placement[role]
    res = pl.resources(p)
    annotations = pl.annotations(role) | ({PROGRESS_ANNOTATION: "0/1"} if reports_progress else {})
    return Container(
        name=name,
        image=step.image,
        command=step.command,
        args=step.args,
        inputs=inputs,
        env=extra.pop("env", None) or [EnvVar(**e) for e in pl.env()],
        resources=ResourceRequirements(**res) if res else None,
        node_selector=pl.node_selector(cfg, role) or None,
        affinity=Affinity.model_validate(affinity) if (affinity := pl.node_affinity(cfg, role)) else None,
        tolerations=[Toleration(**t) for t in pl.tolerations(p)] or None,
        priority_class_name=p.priority_class,
        retry_strategy=retry_for(
            cfg.retries[retries or role], p.spot, client=retries is not None and not server, server=server
        ),
        labels=pl.labels(cfg, name, iteration),
        annotations=annotations or None,
        volumes=[Volume.model_validate(v) for v in pl.volumes(p)],
        volume_mounts=[VolumeMount.model_validate(m) for m in pl.volume_mounts(p)],
        pod_security_context=PodSecurityContext.model_validate(pl.pod_security_context()),
        security_context=SecurityContext.model_validate(pl.container_security_context()),
        **extra,
    )


def _tracked_env(cfg: RunConfig) -> list[EnvVar]:
    """Every step's env, plus the trackers' credentials (secretKeyRefs) for the steps that log to them."""
    return [EnvVar.model_validate(e) for e in pl.env() + pl.tracking_env(cfg)]


def _iteration_step(cfg: RunConfig, name: str, step: StepCommand, **extra: object) -> Container:
    """A step that runs once per iteration: the iteration is its one input, and a label of its pod."""
    inputs = [Parameter(name="iteration")]
    return _step_container(cfg, name, step, inputs=inputs, iteration=ITERATION, **extra)


def plan_template(cfg: RunConfig, numbering: Numbering) -> Container:
    step = step_command(cfg, graph.PLAN, first=numbering.first(), last=numbering.last())
    latest = Parameter(name="latest", value_from=ValueFrom(path=f"{PLAN_OUT}/latest"))
    return _step_container(cfg, graph.PLAN, step, outputs=[latest], reports_progress=True)


def import_sft_template(cfg: RunConfig) -> Container:
    return _step_container(cfg, graph.IMPORT_SFT, step_command(cfg, graph.IMPORT_SFT), reports_progress=True)


def rollout_template(cfg: RunConfig) -> Container:
    """A rollout shard: with rollout.servers, a client on a CPU node that sends its chunks to the servers and
    is retried, with the rollout's budget, when its server is lost."""
    inputs = [Parameter(name="iteration"), Parameter(name="shard"), Parameter(name="policy-version")]
    step = step_command(cfg, "rollout")
    retries = "rollout" if rollout_served(cfg, ARGO) else None
    return _step_container(
        cfg, "rollout", step, inputs=inputs, iteration=ITERATION, reports_progress=True, retries=retries
    )


def _server_container(
    cfg: RunConfig,
    template: str,
    registered_as: str,
    env: list[EnvVar],
    step: StepCommand | None = None,
    **extra: object,
) -> Container:
    """A long-lived server's daemon: ready once its registration answers /health as ready (an exec probe, as it
    listens on a port of the system's choosing), reached at POD_IP, retried as a server (retry.py)."""
    probe = Probe(
        exec=ExecAction(command=server_probe(cfg, registered_as)),
        period_seconds=5,
        timeout_seconds=10,
        failure_threshold=1,
    )
    return _step_container(
        cfg,
        template,
        step or step_command(cfg, template),
        reports_progress=True,
        server=True,
        daemon=True,
        readiness_probe=probe,
        env=[*env, EnvVar.model_validate(pl.POD_IP_ENV)],
        **extra,
    )


def rollout_server_template(cfg: RunConfig) -> Container:
    """A rollout server: a daemon on the rollout pool (Spot), ready once its engine is, retried as a rollout
    pod is when it is reclaimed."""
    env = [EnvVar(**e) for e in pl.env()]
    name = rollout_server_name(ARGO.server)
    return _server_container(cfg, graph.ROLLOUT_SERVER, name, env, inputs=[Parameter(name="server")])


def trainer_server_template(cfg: RunConfig) -> Container:
    """The trainer that stays up for a segment (trainer.server): a daemon, ready once rank 0 answers /health as
    ready, restarted by its retryStrategy after a crash or a reclaim; server_tasks puts it in the segment's DAG.
    On one node the daemon is the trainer, placed and sized as the update (its torchrun holds the GPUs); over
    trainer.nodes nodes it is the launcher of the trainer's PyTorchJob (pytorchjob.trainer_server_manifest),
    on a control node: it fails when the job does, and deletes the job when Argo stops it."""
    if cfg.trainer.nodes == 1:
        return _server_container(cfg, TRAINER_SERVER, TRAINER_SERVER_NAME, _tracked_env(cfg))
    job = pytorchjob.trainer_server_manifest(cfg, ARGO.workflow, "{{workflow.uid}}")
    launcher = pytorchjob_launcher_command(cfg, job, server=True)
    env = [EnvVar(**e) for e in pl.env()]
    return _server_container(cfg, TRAINER_SERVER, TRAINER_SERVER_NAME, env, launcher, retries="trainer")


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
    step = step_command(cfg, "score", metrics_out=SCORE_METRICS_PATH)
    # The metrics feed only the Prometheus gauges (the store has them too): a missing file is no failure.
    metrics_json = Parameter(name="metrics", value_from=ValueFrom(path=SCORE_METRICS_PATH, default="{}"))
    return _iteration_step(
        cfg,
        "score",
        step,
        outputs=[metrics_json],
        metrics=score_metrics(cfg),
        reports_progress=True,
        env=_tracked_env(cfg),
    )


UPDATE_CLEAR, UPDATE_JOB = "update-clear", "update-job"


def update_template(cfg: RunConfig) -> Container | Steps:
    """torchrun in one pod, or a PyTorchJob over trainer.nodes nodes (pytorchjob.py says why it is built so):
    each attempt of `update` first deletes the iteration's job and waits until its pods are gone, then
    creates it anew and waits for its Master to succeed or for its Failed condition. With a trainer that
    stays up, on any number of nodes, the update is its client: one pod on a CPU node."""
    if cfg.trainer.nodes == 1 or trainer_served(cfg, ARGO):
        step = step_command(cfg, "update")
        retries = "trainer" if trainer_served(cfg, ARGO) else None  # a client: also retried when its trainer is lost
        return _iteration_step(cfg, "update", step, env=_tracked_env(cfg), reports_progress=True, retries=retries)
    argument = {"iteration": ITERATION}
    return Steps(
        name="update",
        inputs=[Parameter(name="iteration")],
        retry_strategy=retry_for(cfg.retries["trainer"], spot=False),
        sub_steps=[
            Step(name="clear", template=UPDATE_CLEAR, arguments=argument),
            Step(name="job", template=UPDATE_JOB, arguments=argument),
        ],
    )


def update_job_templates(cfg: RunConfig) -> list[Resource]:
    """The two resource templates of a multi-node update: delete the iteration's job, create and wait."""
    clear = Resource(
        name=UPDATE_CLEAR,
        action="delete",  # Argo adds --ignore-not-found
        flags=["--cascade=foreground", "--wait=true"],  # returns once the job's pods are gone
        manifest=yaml.safe_dump(pytorchjob.reference(cfg, ITERATION), sort_keys=False),
        inputs=[Parameter(name="iteration")],
        labels=pl.labels(cfg, UPDATE_CLEAR, ITERATION),
    )
    job = Resource(
        name=UPDATE_JOB,
        action="create",
        set_owner_reference=True,  # the job goes when the Workflow goes
        manifest=pytorchjob.manifest_yaml(cfg, ITERATION),
        success_condition=pytorchjob.SUCCESS_CONDITION,
        failure_condition=pytorchjob.FAILURE_CONDITION,
        active_deadline_seconds=WAIT_DEADLINE_SECONDS,
        inputs=[Parameter(name="iteration")],
        labels=pl.labels(cfg, "update", ITERATION),
    )
    return [clear, job]


def publish_template(cfg: RunConfig) -> Container:
    return _iteration_step(cfg, "publish", step_command(cfg, "publish"), reports_progress=True)


def report_template(cfg: RunConfig) -> Container:
    """The exit handler: metrics table, report.md and the reward/accuracy PNG, whatever the outcome."""
    step = step_command(
        cfg,
        graph.REPORT,
        status="{{workflow.status}}",
        workflow_name="{{workflow.name}}",  # the trackers' tag and link, and whose step times to read
        namespace="{{workflow.namespace}}",
    )
    # Unarchived, so that the Argo UI shows the PNG itself.
    png = Artifact(name="report-png", path=f"{REPORT_OUT}/report.png", archive=NoneArchiveStrategy())
    outputs = [png] if cfg.argo.report_artifact else None
    return _step_container(cfg, graph.REPORT, step, outputs=outputs, env=_tracked_env(cfg))


NEXT_SEGMENT_CRON = "next-segment-cron"  # looks the run's CronWorkflow up
NEXT_SEGMENT_OWNED, NEXT_SEGMENT_ALONE = "next-segment-owned", "next-segment-alone"  # as its child, or plain
CRON_UID = "cron-uid"


def cron_name(cfg: RunConfig) -> str:
    return f"{cfg.name}-continue"


def next_segment_templates(cfg: RunConfig, next_template: str, numbering: Numbering) -> list[Steps | Resource]:
    """Submit the next segment's Workflow, from the same template with `first` one segment on; the run's mutex
    holds it until this one has finished.

    With the run's CronWorkflow present, the next segment is created as the cron's own child (its controller
    ownerReference and its label): Argo's cron controller counts every unfinished Workflow so owned as active
    (cron/controller.go groupWorkflows, operator.go reconcileActiveWfs), so `concurrencyPolicy: Forbid` skips
    a firing while any segment of the run is still going, instead of starting a second chain of segments
    that would queue on the mutex and the semaphore. Without a cron the Workflow is created plain."""
    # The parent's name lets `moerl submit --wait` follow the run from segment to segment (wait.py).
    index = f"{{{{={numbering.segment_index()} + 1}}}}"
    labels = {pl.RUN_LABEL: cfg.name, pl.SEGMENT_LABEL: index, PARENT_LABEL: "{{workflow.name}}"}

    def workflow(owned: bool) -> str:
        metadata: dict = {"generateName": f"{cfg.name}-", "labels": dict(labels)}
        if owned:
            metadata["labels"][CRON_LABEL] = cron_name(cfg)
            metadata["ownerReferences"] = [
                {"apiVersion": "argoproj.io/v1alpha1", "kind": "CronWorkflow", "name": cron_name(cfg),
                 "uid": f"{{{{inputs.parameters.{CRON_UID}}}}}", "controller": True, "blockOwnerDeletion": False}
            ]  # fmt: skip
        first = {"parameters": [{"name": FIRST, "value": numbering.next_first()}]}
        body = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": metadata,
                "spec": {"workflowTemplateRef": {"name": next_template}, "arguments": first}}  # fmt: skip
        # One line per value: Argo substitutes the tags in the text before it parses it.
        return yaml.safe_dump(body, sort_keys=False, width=1 << 20)

    retry = retry_for(cfg.retries["control"], False)
    cron = {"apiVersion": "argoproj.io/v1alpha1", "kind": "CronWorkflow", "metadata": {"name": cron_name(cfg)}}
    uid = Parameter(name=CRON_UID, default="", value_from=ValueFrom(json_path="{.metadata.uid}", default=""))
    found = f"{{{{steps.cron.outputs.parameters.{CRON_UID}}}}}"
    return [
        Steps(
            name=graph.NEXT_SEGMENT,
            sub_steps=[
                Step(name="cron", template=NEXT_SEGMENT_CRON),
                [
                    Step(name="owned", template=NEXT_SEGMENT_OWNED, when=f"'{found}' != ''",
                         arguments={CRON_UID: found}),  # fmt: skip
                    Step(name="alone", template=NEXT_SEGMENT_ALONE, when=f"'{found}' == ''"),
                ],
            ],
        ),
        # --ignore-not-found: no cron, empty output, and Argo gives the output parameter its default
        Resource(name=NEXT_SEGMENT_CRON, action="get", flags=["--ignore-not-found"],
                 manifest=yaml.safe_dump(cron, sort_keys=False), outputs=[uid], retry_strategy=retry),  # fmt: skip
        Resource(name=NEXT_SEGMENT_OWNED, action="create", manifest=workflow(True),
                 inputs=[Parameter(name=CRON_UID)], retry_strategy=retry),  # fmt: skip
        Resource(name=NEXT_SEGMENT_ALONE, action="create", manifest=workflow(False), retry_strategy=retry),
    ]


def main_dag(cfg: RunConfig, numbering: Numbering) -> DAG:
    """Unroll the segment's positions. Tasks of iterations that LATEST already covers are skipped, and those past
    the run's end."""
    latest = f"{{{{tasks.{graph.PLAN}.outputs.parameters.latest}}}}"
    tasks = []
    for name, deps in graph.run_dependencies(numbering.segment, cfg, servers_run=True).items():
        step, _, number = name.rpartition("-")
        depends = " && ".join(deps) or None
        if step not in graph.STEPS:  # plan, import-sft (only before the first LATEST), next-segment
            when = {graph.IMPORT_SFT: f"{latest} < 0", graph.NEXT_SEGMENT: numbering.has_next()}.get(name)
            tasks.append(Task(name=name, template=name, depends=depends, when=when))
            continue
        i = int(number)
        arguments = {"iteration": numbering.iteration(i)}
        shards = None
        if step == "rollout":
            arguments |= {"shard": "{{item}}", "policy-version": numbering.policy_version(i, cfg.staleness)}
            shards = Sequence(count=str(cfg.rollout.num_shards))
            depends = " && ".join([*deps, *served_by(cfg)])
        if step == "update":
            depends = " && ".join([*deps, *trained_by(cfg)])
        tasks.append(
            Task(
                name=name,
                template=step,
                depends=depends,
                when=numbering.to_do(latest, i),
                arguments=arguments,
                with_sequence=shards,
            )
        )
    return DAG(name=MAIN, tasks=server_tasks(cfg, numbering, latest) + tasks)


def served_by(cfg: RunConfig) -> list[str]:
    """What a rollout task adds to its `depends` with rollout servers: each server, ready or failed for good.

    The edge matters to Argo beyond the picture (controller v4.1.2, operator.go executeTemplate and
    processNodeRetries): a daemon's Retry node starts a new attempt after its pod was lost only while some task
    below the lost attempt is unfinished, and the tasks below it are its dependents; a server nobody depended on
    would never be replaced. Its `.Failed`/`.Errored` keep a server whose retries are spent from omitting the
    rollouts (their clients then use another server) and make its failure theirs to report, not the DAG's."""
    if not rollout_served(cfg, ARGO):
        return []
    return [_ready_or_failed(rollout_server_name(k)) for k in range(cfg.rollout.servers)]


def _ready_or_failed(name: str) -> str:
    return f"({name} || {name}.Failed || {name}.Errored)"


def trained_by(cfg: RunConfig) -> list[str]:
    """What an update task adds to its `depends` with a trainer that stays up (as served_by, for the trainer)."""
    return [_ready_or_failed(TRAINER_SERVER)] if trainer_served(cfg, ARGO) else []


def server_tasks(cfg: RunConfig, numbering: Numbering, latest: str) -> list[Task]:
    """The segment's rollout servers and its trainer that stays up: daemons from the start of the segment to
    its end, when Argo stops them; none when the segment has nothing left to do. They start beside import-sft,
    whose v000000 they wait for, so that their nodes, images and imports overlap the import. Every rollout
    depends on the rollout servers (served_by) and every update on the trainer (trained_by); the clients find
    them through the run store: a replacement's address is new, and Argo holds no dependent back while a
    daemon's new attempt starts."""
    when = numbering.anything_to_do(latest)
    rollout = [
        Task(name=rollout_server_name(k), template=graph.ROLLOUT_SERVER, depends=graph.PLAN, when=when,
             arguments={"server": str(k)})
        for k in range(cfg.rollout.servers if rollout_served(cfg, ARGO) else 0)
    ]  # fmt: skip
    trainer = [Task(name=TRAINER_SERVER, template=TRAINER_SERVER, depends=graph.PLAN, when=when)]
    return rollout + (trainer if trainer_served(cfg, ARGO) else [])


def templates(cfg: RunConfig, segment: graph.Segment, next_template: str | None, parameterized: bool = False) -> list:
    """The templates of a Workflow that runs `segment`'s positions: the whole run (literal iterations), or with
    `parameterized` the shape of every segment (graph.template_shape), whose Workflows give their first iteration
    as the parameter `first`. `next_template`: the template that next-segment submits (a run of several
    segments)."""
    numbering = Numbering(segment, cfg.iterations, parameterized)
    out = [main_dag(cfg, numbering), plan_template(cfg, numbering)]
    if segment.is_first:
        out.append(import_sft_template(cfg))
    out += [
        *([rollout_server_template(cfg)] if rollout_served(cfg, ARGO) else []),
        *([trainer_server_template(cfg)] if trainer_served(cfg, ARGO) else []),
        rollout_template(cfg),
        score_template(cfg),
        update_template(cfg),
        *(update_job_templates(cfg) if cfg.trainer.nodes > 1 and not trainer_served(cfg, ARGO) else []),
        publish_template(cfg),
        report_template(cfg),
    ]
    if next_template is not None:
        out += next_segment_templates(cfg, next_template, numbering)
    return out
