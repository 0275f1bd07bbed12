"""The same run as a Kubeflow Pipelines (KFP 2) pipeline, compiled to KFP's IR YAML.

One container component per step, unrolled over one segment of iteration slots with the dependencies of
pipelines.workflow.graph (staleness included); rollouts fan out with dsl.ParallelFor; the report is the exit
task. Placement comes from kfp-kubernetes (node selectors, tolerations, /dev/shm, pod labels and the Karpenter
annotation) and from the task API (CPU, memory and GPU requests and limits).

Resume and long runs: the pipeline starts with `plan`, which reads LATEST and outputs the next iteration F.
Slot j of the pipeline runs iteration F + j - 1 through `python -m steps.plan --first-iteration F --slot j-1
-- COMMAND`, which skips iterations LATEST already covers or that lie past the run's end. So one pipeline run
does at most segment_size iterations from wherever the run stands, and running it again (by hand or as a KFP
recurring run with max concurrency 1) continues the run; the pipeline stays small however long the run is.

What KFP cannot say (see docs/kfp.md): set_retry retries failed tasks only, so a pod deleted with its Spot node
is not requeued; EFA devices, hugepages and priority classes cannot be requested per task. A multi-node update
runs a launcher pod that creates the PyTorchJob through the Kubernetes API (`python -m
steps.pytorchjob_launcher`) and waits for it.

Each task's command line, role and image come from pipelines.workflow.commands, as the Argo templates' do.
"""

from pathlib import Path
from typing import Any

from kfp import compiler, dsl, kubernetes

from pipelines.durations import parse_duration
from pipelines.workflow import graph, pytorchjob
from pipelines.workflow import placement as pl
from pipelines.workflow.commands import KFP, StepCommand, flags, pytorchjob_launcher_command, step_command
from steps.run.config import Placement, Retry, RunConfig

SLOT_LABEL = "moerl.io/slot"


def seconds(duration: str) -> str:
    """An Argo duration ('2s', '5m', '1h', '30') as KFP's seconds string ('300s')."""
    return f"{int(parse_duration(duration))}s"


def _component(name: str, image: str, argv: list[str], inputs: tuple[str, ...] = ()) -> Any:
    """A container component that runs argv; '{first}' and '{shard}' in argv become those inputs."""

    def fill(values: dict[str, Any]) -> dsl.ContainerSpec:
        args = [values.get(a[1:-1], a) if a in ("{first}", "{shard}") else a for a in argv[1:]]
        return dsl.ContainerSpec(image=image, command=argv[:1], args=args)

    def plain() -> dsl.ContainerSpec:
        return fill({})

    def slot(first: int) -> dsl.ContainerSpec:
        return fill({"first": first})

    def sharded_slot(first: int, shard: int) -> dsl.ContainerSpec:
        return fill({"first": first, "shard": shard})

    fn = {(): plain, ("first",): slot, ("first", "shard"): sharded_slot}[inputs]
    fn.__name__ = name.replace("-", "_")  # KFP names the component after the function
    return dsl.container_component(fn)


def _guarded(cfg: RunConfig, slot: int, argv: list[str]) -> list[str]:
    """Run argv for iteration first + slot - 1 unless it is published or past the run's end."""
    guard = flags(
        run=cfg.run_store, first_iteration="{first}", slot=slot - 1, iterations=cfg.iterations, staleness=cfg.staleness
    )
    return [*step_command(cfg, graph.PLAN).command, *guard, "--", *argv]


def _place(task: Any, cfg: RunConfig, role: str, step: str, iteration: int | None, retry: bool = True) -> Any:
    p: Placement = cfg.placement[role]
    task.set_caching_options(False)  # a step's effect is on the store, never to be replayed from a cache
    # Slot j runs the j-th iteration after LATEST: on a fresh run, iteration j.
    task.set_display_name(step if iteration is None else f"{step}-slot-{iteration}")
    for key, value in pl.node_selector(cfg, role).items():
        kubernetes.add_node_selector(task, key, value)
    if (affinity := pl.node_affinity(cfg, role)) is not None:  # on-demand or reserved capacity
        for term in affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]:
            kubernetes.add_node_affinity(task, match_expressions=term["matchExpressions"])  # no weight: required
    for t in p.tolerations:
        kubernetes.add_toleration(
            task,
            key=t.key,
            operator=t.operator,
            value=t.value,
            effect=t.effect,
            toleration_seconds=t.toleration_seconds,
        )
    pod_labels = pl.labels(cfg, step)
    if iteration is not None:
        pod_labels[SLOT_LABEL] = str(iteration)
    for key, value in pod_labels.items():
        kubernetes.add_pod_label(task, key, value)
    for key, value in pl.annotations(role).items():
        kubernetes.add_pod_annotation(task, key, value)
    if p.shm_size is not None:
        kubernetes.empty_dir_mount(
            task, volume_name=pl.SHM_VOLUME, mount_path="/dev/shm", medium="Memory", size_limit=p.shm_size
        )
    _resources(task, p)
    # What kfp-kubernetes can set: the images' non-root user (KFP adds no-privilege-escalation, drop ALL and
    # RuntimeDefault seccomp itself). It has no read-only root filesystem setting: docs/reliability.md.
    kubernetes.set_security_context(task, run_as_user=pl.RUN_AS_UID, run_as_group=pl.RUN_AS_GID, run_as_non_root=True)
    for name, value in pl.STEP_ENV.items():
        task.set_env_variable(name, value)
    if step in TRACKED_STEPS:  # the trackers' credentials, as optional Secret refs (placement.tracking_env)
        _tracking_secrets(task, cfg)
    if retry:
        r: Retry = cfg.retries[role]
        task.set_retry(
            num_retries=r.limit,
            backoff_duration=seconds(r.backoff.duration),
            backoff_factor=float(r.backoff.factor),
            backoff_max_duration=seconds(r.backoff.max_duration) if r.backoff.max_duration else None,
        )
    return task


TRACKED_STEPS = ("score", "update", "report")


def _tracking_secrets(task: Any, cfg: RunConfig) -> None:
    by_secret: dict[tuple[str, bool], dict[str, str]] = {}
    for entry in pl.tracking_env(cfg):
        ref = entry["valueFrom"]["secretKeyRef"]
        by_secret.setdefault((ref["name"], ref["optional"]), {})[ref["key"]] = entry["name"]
    for (secret, optional), key_to_env in by_secret.items():
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=key_to_env, optional=optional)


def _resources(task: Any, p: Placement) -> None:
    res = pl.resources(p)
    requests, limits = res.get("requests", {}), res.get("limits", {})
    setters = {
        ("requests", "cpu"): task.set_cpu_request,
        ("limits", "cpu"): task.set_cpu_limit,
        ("requests", "memory"): task.set_memory_request,
        ("limits", "memory"): task.set_memory_limit,
    }
    for kind, values in (("requests", requests), ("limits", limits)):
        for name, value in values.items():
            if (kind, name) in setters:
                setters[kind, name](value)
    if "nvidia.com/gpu" in limits:
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(limits["nvidia.com/gpu"])


def slots(cfg: RunConfig) -> graph.Segment:
    """The pipeline's iteration slots: one segment; slot j runs the j-th iteration after LATEST."""
    return graph.Segment(0, 1, 1, min(cfg.iterations, cfg.segment_size))


def _iteration_command(cfg: RunConfig, step: str) -> StepCommand:
    """The step's command with '{iteration}', '{policy_version}' and '{shard}' left for run time; a multi-node
    update is a launcher that creates the PyTorchJob and waits for it."""
    if step == "update" and cfg.trainer.nodes > 1:
        return pytorchjob_launcher_command(cfg, pytorchjob.manifest(cfg, KFP.iteration))
    return step_command(cfg, step, KFP)


def build_pipeline(cfg: RunConfig) -> Any:
    """The KFP pipeline function: plan, import-sft, then segment_size iteration slots, then the report."""
    deps = graph.run_dependencies(slots(cfg), cfg, servers_run=False)  # no daemons on KFP

    @dsl.pipeline(
        name=cfg.name,
        description=f"moerl RL run {cfg.name}: up to {cfg.segment_size} iterations "
        f"per pipeline run, from LATEST, of {cfg.iterations}",
    )
    def pipeline() -> None:
        report_step = step_command(cfg, graph.REPORT, KFP, status="finished")
        report = _component(graph.REPORT, report_step.image, report_step.argv)()
        report = _place(report, cfg, report_step.role, graph.REPORT, None)
        with dsl.ExitHandler(report, name="run"):
            plan_step = step_command(cfg, graph.PLAN, KFP, first=1, last=cfg.iterations, next_out="{next}")
            plan = _plan_component(plan_step.image, plan_step.argv)()
            tasks: dict[str, Any] = {graph.PLAN: _place(plan, cfg, plan_step.role, graph.PLAN, None)}
            first = plan.outputs["next"]
            import_step = step_command(cfg, graph.IMPORT_SFT, KFP)
            import_argv = [*plan_step.command, *flags(run=cfg.run_store, unless_published=0), "--", *import_step.argv]
            imported = _component(graph.IMPORT_SFT, import_step.image, import_argv)()
            tasks[graph.IMPORT_SFT] = _place(imported, cfg, import_step.role, graph.IMPORT_SFT, None).after(plan)
            for name, parents in deps.items():
                if name in tasks:
                    continue
                step, _, number = name.rpartition("-")
                slot = int(number)
                command = _iteration_command(cfg, step)
                argv, image, role = _guarded(cfg, slot, command.argv), command.image, command.role
                if step == "rollout":
                    with dsl.ParallelFor(items=list(range(cfg.rollout.num_shards)), name=name) as shard:
                        task = _component(name, image, argv, ("first", "shard"))(first=first, shard=shard)
                else:
                    task = _component(name, image, argv, ("first",))(first=first)
                task = _place(task, cfg, role, step, slot)
                for parent in parents:
                    task.after(tasks[parent])
                tasks[name] = task

    return pipeline


def _plan_component(image: str, argv: list[str]) -> Any:
    """plan, with the next iteration as the output parameter `next` (an int)."""

    def plan(next: dsl.OutputPath(int)) -> dsl.ContainerSpec:  # noqa: A002 (the output's name)
        return dsl.ContainerSpec(image=image, command=argv[:1], args=[next if a == "{next}" else a for a in argv[1:]])

    return dsl.container_component(plan)


def compile_pipeline(cfg: RunConfig, path: str | Path) -> Path:
    """Compile the pipeline to KFP IR YAML at `path`."""
    path = Path(path)
    compiler.Compiler().compile(build_pipeline(cfg), str(path))
    return path
