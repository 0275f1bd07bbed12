"""Each step kind's command line, placement role and image, built once for the Argo templates, the KFP
pipeline and the local tools.

Steps read everything else from <run>/run.json, so a command passes only the run store and what varies
from pod to pod (the iteration, the shard, the policy version). Those are left as placeholders that each
builder fills its own way: Argo with `{{inputs.parameters.X}}` (ARGO), KFP with `{X}` that its components
substitute at run time (KFP). No Hera and no kfp here: both builders, and `moerl demo`, import this.

What a new step kind needs, in order (docs/architecture.md, "Where a change goes", repeats this list):
  1. its module, steps/<name>.py, runnable as `python -m steps.<name> --help` (a step imports libraries,
     never another step);
  2. an entry in STEP_KINDS below (module, role, image) and its flags in `step_command`;
  3. its place in the run's DAG: pipelines/workflow/graph.py (`STEPS` and `dependencies`);
  4. its Argo template in pipelines/workflow/templates.py (inputs, outputs, progress) and, where KFP runs it
     differently (a guard, an output parameter), its task in pipelines/kfp_pipeline.py;
  5. for a new role: its `placement` and `retries` entries in the run config;
  6. its step times in the simulator, pipelines/simulate/sizing.py (`StepModel`), when it takes time of its own;
  7. its row in docs/architecture.md's table of steps, and a test next to the behaviour.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipelines.workflow import graph
from steps.run.config import RunConfig
from steps.run.keys import rollout_server_name

# The files each step writes for its orchestrator to read back (Argo output parameters and artifacts). They
# lie on the pods' /tmp emptyDir (placement.py), where Argo's executor can read them under a read-only root.
PLAN_OUT = "/tmp/plan"
SCORE_METRICS_PATH = "/tmp/metrics.json"
REPORT_OUT = "/tmp/report"


@dataclass(frozen=True)
class Slots:
    """How a builder spells the values that differ from pod to pod."""

    iteration: str
    shard: str
    policy_version: str
    server: str | None = None  # a rollout server's index
    workflow: str | None = None  # the Workflow's name, where an orchestrator runs long-lived servers


ARGO = Slots(
    "{{inputs.parameters.iteration}}",
    "{{inputs.parameters.shard}}",
    "{{inputs.parameters.policy-version}}",
    server="{{inputs.parameters.server}}",
    workflow="{{workflow.name}}",
)
# KFP has no daemon tasks: its rollout steps open engines of their own (rollout.servers is Argo's).
KFP = Slots("{iteration}", "{shard}", "{policy_version}")


@dataclass(frozen=True)
class StepKind:
    module: str  # python -m MODULE
    role: str  # the key of its placement and retries in the run config
    image: str  # the field of cfg.images its container runs


STEP_KINDS: dict[str, StepKind] = {
    "plan": StepKind("steps.plan", "control", "cpu"),
    "import-sft": StepKind("steps.import_sft", "control", "cpu"),
    "rollout": StepKind("steps.rollout", "rollout", "rollout"),
    "rollout-server": StepKind("steps.rollout_server", "rollout", "rollout"),
    "score": StepKind("steps.score", "score", "cpu"),
    "update": StepKind("steps.update", "trainer", "trainer"),
    "trainer-server": StepKind("steps.trainer_server", "trainer", "trainer"),
    "publish": StepKind("steps.publish", "control", "cpu"),
    "report": StepKind("steps.report", "control", "cpu"),
}
# A multi-node update's launcher: it creates the iteration's PyTorchJob and waits for it (KFP; Argo uses
# resource templates instead). The job's pods carry the trainer's placement and image.
PYTORCHJOB_LAUNCHER = StepKind("steps.pytorchjob_launcher", "control", "cpu")


@dataclass(frozen=True)
class StepCommand:
    """A container's command line, and the role and image it runs with."""

    role: str
    image: str
    command: list[str]
    args: list[str]

    @property
    def argv(self) -> list[str]:
        return [*self.command, *self.args]


def flags(**values: object) -> list[str]:
    """--name value pairs, in order; underscores in names become dashes."""
    return [item for name, value in values.items() for item in (f"--{name.replace('_', '-')}", str(value))]


def config_json(cfg: RunConfig) -> str:
    """The resolved run config as the steps that write run.json take it (plan, import-sft)."""
    return json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def python_step(module: str) -> list[str]:
    return ["python", "-m", module]


def warm_preload() -> tuple[str, ...]:
    """What the local executor's warm Python imports once for a run: the modules of the steps that run every
    iteration (plan, import-sft and the report come once a run, and the report's imports are its own)."""
    return tuple(STEP_KINDS[kind].module for kind in graph.STEPS)


def torchrun_args(cfg: RunConfig, iteration: str) -> list[str]:
    """torchrun's arguments for the update: one node standalone, or one replica of a PyTorchJob."""
    return _torchrun(cfg, "update", ["--run", cfg.run_store, "--iteration", iteration])


def trainer_server_args(cfg: RunConfig, workflow: str) -> list[str]:
    """torchrun's arguments for the trainer that stays up: one node standalone, or one replica of its PyTorchJob."""
    return _torchrun(cfg, "trainer-server", flags(run=cfg.run_store, workflow=workflow))


def _torchrun(cfg: RunConfig, kind: str, step_args: list[str]) -> list[str]:
    t = cfg.trainer
    args = ["--nproc-per-node", str(t.nproc_per_node)]
    if t.nodes == 1:
        args += ["--standalone", "--nnodes", "1"]
    else:
        args += ["--nnodes", str(t.nodes)]
    # "--" ends torchrun's own options: its argparse would take the step's --run for an abbreviation of
    # --run-path ("ambiguous option"). torchrun drops the "--" before starting the script.
    return [*args, "-m", STEP_KINDS[kind].module, "--", *step_args]


def trainer_served(cfg: RunConfig, at: Slots) -> bool:
    """Whether the update steps send their iteration to the Workflow's trainer that stays up (Argo,
    trainer.server)."""
    return cfg.trainer.server and at.workflow is not None


def _args(cfg: RunConfig, kind: str, at: Slots, first: int | str, last: int | str) -> list[str]:
    run = cfg.run_store
    if kind == "plan":
        return flags(run=run, first=first, last=last, out=PLAN_OUT, run_config_json=config_json(cfg))
    if kind == "import-sft":
        return flags(src=cfg.sft_checkpoint, run=run, run_config_json=config_json(cfg))
    if kind == "rollout":
        served = flags(workflow=at.workflow) if rollout_served(cfg, at) else []
        return (
            flags(
                run=run,
                iteration=at.iteration,
                shard=at.shard,
                num_shards=cfg.rollout.num_shards,
                policy_version=at.policy_version,
            )
            + served
        )
    if kind == "rollout-server":
        return flags(run=run, workflow=at.workflow, name=rollout_server_name(at.server))
    if kind == "report":
        return flags(run=run, out=REPORT_OUT)
    return flags(run=run, iteration=at.iteration)  # score, publish


def rollout_served(cfg: RunConfig, at: Slots) -> bool:
    """Whether the rollout steps send their chunks to long-lived servers (Argo, rollout.servers > 0)."""
    return cfg.rollout.servers > 0 and at.workflow is not None


def server_probe(cfg: RunConfig, name: str, at: Slots = ARGO) -> list[str]:
    """A long-lived server's readinessProbe command (exec): ready once registered and answering as ready."""
    return python_step("steps.server_probe") + flags(run=cfg.run_store, workflow=at.workflow, server=name)


def step_command(
    cfg: RunConfig,
    kind: str,
    at: Slots = ARGO,
    *,
    first: int | str = 1,
    last: int | str | None = None,
    **more: object,
) -> StepCommand:
    """The container of a step kind; `more` appends flags (what one orchestrator reads back that the other
    does not, such as Argo's --metrics-out or the report's --status). `first`/`last`: plan's iterations (or
    the Argo tags that give them in a segment template).
    A single-node update is torchrun; a multi-node one is built by `pytorchjob_launcher_command` or, on Argo,
    by resource templates."""
    step = STEP_KINDS[kind]
    image = getattr(cfg.images, step.image)
    if kind == "update":
        if trainer_served(cfg, at):  # a client of the trainer: no GPU; on-demand CPU nodes
            args = flags(run=cfg.run_store, iteration=at.iteration, workflow=at.workflow, **more)
            return StepCommand("control", cfg.images.cpu, python_step(step.module), args)
        if cfg.trainer.nodes != 1:
            raise ValueError("a multi-node update has no container of its own: see pytorchjob_launcher_command")
        return StepCommand(step.role, image, ["torchrun"], torchrun_args(cfg, at.iteration) + flags(**more))
    if kind == "trainer-server":
        if cfg.trainer.nodes != 1:
            raise ValueError("a multi-node trainer server is a PyTorchJob: see pytorchjob_launcher_command")
        assert at.workflow is not None, "a trainer server serves one Workflow"
        return StepCommand(step.role, image, ["torchrun"], trainer_server_args(cfg, at.workflow) + flags(**more))
    args = _args(cfg, kind, at, first, cfg.iterations if last is None else last)
    if kind == "rollout" and rollout_served(cfg, at):  # a client: no engine, no GPU; on-demand CPU nodes
        return StepCommand("control", cfg.images.cpu, python_step(step.module), args + flags(**more))
    return StepCommand(step.role, image, python_step(step.module), args + flags(**more))


def pytorchjob_launcher_command(cfg: RunConfig, job: dict, *, server: bool = False) -> StepCommand:
    """The launcher pod that creates `job` and waits for it: a multi-node update on KFP (pytorchjob.manifest),
    or on Argo the daemon of a multi-node trainer that stays up (`server`: pytorchjob.trainer_server_manifest,
    waited for without a deadline, deleted when the daemon is stopped)."""
    launcher = PYTORCHJOB_LAUNCHER
    args = flags(manifest_json=json.dumps(job), namespace=cfg.namespace)
    if server:
        args += flags(deadline_seconds=0)
    return StepCommand(launcher.role, getattr(cfg.images, launcher.image), python_step(launcher.module), args)
