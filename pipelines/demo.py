"""`moerl demo` and `moerl run`: the whole workflow on this machine, with the local executor.

`moerl run CONFIG` renders a run config and runs its self-contained workflow.yaml here.
`moerl demo` is the embedded default: it builds the demo SFT checkpoint when missing, runs
configs/demo.yaml on a file:// store under --workdir, and prints the report. Both write the Argo manifests
they run under <workdir>/rendered; `moerl render` writes the KFP pipeline as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.config import load_config
from pipelines.local import RunResult, parse_chaos, run_workflow
from pipelines.preflight import preflight_or_exit
from pipelines.workflow import commands, graph, placement
from steps.errors import MoerlError
from steps.run.config import RunConfig
from steps.run.keys import CHECKPOINTS, LATEST, REPORT_MD_KEY, REPORT_PNG_KEY, RUN_CONFIG, TENSORBOARD_PREFIX
from steps.store.object_store import Store
from steps.tracking.trackers import STATUS_FILE_ENV
from steps.tracking.workflow_status import step_nodes

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
DEMO_CHAT_SFT_STEPS = 50  # SFT steps of the chat demo's checkpoint (configs/demo-chat.yaml)
# The tool demo's checkpoint (configs/demo-tool.yaml): its BPE learns the tools' schema and the call format as
# a few tokens, and its positions hold the whole conversation.
# Copying the tool's answer appears suddenly, at a step that varies with the seed (train-prompt accuracy 8% at step
# 160 and 64% at 170 for one seed; 5% at 120 and 41% at 140 for another; under a one-cycle schedule over 300 steps a
# third never got past 10%): the SFT keeps its rate after a warmup and stops at the first check, every 5 steps from
# step 100, that reaches DEMO_TOOL_SFT_STOP_AT on train-split prompts, so that every seed's checkpoint calls the
# tool and copies some answers right, with room for RL; DEMO_TOOL_SFT_STEPS is only the cap.
DEMO_TOOL_SFT_STEPS = 600
DEMO_TOOL_SFT_STOP_AT = 0.3
DEMO_TOOL_VOCAB_SIZE = 640
DEMO_TOOL_MAX_POSITIONS = 256
if TYPE_CHECKING:
    from steps.demo.sft import SftSettings

STEP_KINDS = graph.STEPS  # the steps of an iteration, the columns of the wall-time table


def run_config(cfg: RunConfig, workdir: Path, chaos: str | None = None, check: str | None = None) -> RunResult:
    """Render cfg's Argo manifests into workdir/rendered and run its workflow.yaml with the local executor.
    The KFP pipeline is left to `moerl render`: compiling it (and importing kfp) would delay the first pod.

    The executor starts the warm server of the step pods (pipelines/local/pods/warm.py) first, from the environment
    every rendered step pod gets (placement.env), and only then renders (`rendered`), so that the server's
    imports overlap the rendering and the first pods, and, when `check` names the config, the checks of its
    inputs (pipelines/preflight.py: they import torch too).

    The report step reads the Workflow's status (step wall times and retries, for the trackers) from the
    status file that the executor keeps: its path goes to the pods in their environment, set first, so
    that the warm server's environment has it too."""
    outer_status_file = os.environ.get(STATUS_FILE_ENV)
    os.environ[STATUS_FILE_ENV] = str(workdir / "status.json")

    def rendered() -> Path:
        if check is not None:
            preflight_or_exit(cfg, source=check)
        # Imported once the server is importing torch on the other core: rendering needs Hera (~1 s to import).
        from pipelines.render import WORKFLOW, render

        return render(cfg, workdir / "rendered", kfp=False)[WORKFLOW]

    # Any Python step pod: every one has the same environment, so they share the server started for it.
    step_env = {e["name"]: e["value"] for e in placement.env()}
    step_pod = (commands.python_step(commands.STEP_KINDS["plan"].module), step_env)
    try:
        return run_workflow(
            rendered, chaos=chaos, status_out=workdir / "status.json", workdir=workdir / "pods",
            preload=commands.warm_preload(), prestart=[step_pod],
        )  # fmt: skip
    finally:
        if outer_status_file is None:  # another run in this process must not read this run's status
            os.environ.pop(STATUS_FILE_ENV, None)
        else:
            os.environ[STATUS_FILE_ENV] = outer_status_file


def step_seconds(status: dict[str, Any]) -> dict[int, dict[str, float]]:
    """iteration -> step kind -> wall seconds, from Argo-shaped node status (a kind's span across shards)."""
    spans: dict[int, dict[str, list[datetime]]] = defaultdict(lambda: defaultdict(list))
    for node in step_nodes(status):
        if node.step not in STEP_KINDS or node.iteration is None or node.type == "Pod" and node.attempt:
            continue  # a task's own nodes span its attempts (and its shards'); its pods are counted there
        if node.started is None or node.finished is None:
            continue
        spans[node.iteration][node.step] += [node.started, node.finished]
    return {
        i: {kind: (max(s) - min(s)).total_seconds() for kind, s in kinds.items()} for i, kinds in sorted(spans.items())
    }


def print_summary(cfg: RunConfig, result: RunResult, seconds: float) -> None:
    run = Store.open(cfg.run_store)
    print()
    if run.exists(REPORT_MD_KEY):
        print(run.get_bytes(REPORT_MD_KEY).decode())
    times = step_seconds(result.status)
    if times:
        print("step wall times (s): " + "  ".join(f"{k:>8}" for k in STEP_KINDS))
        for i, kinds in times.items():
            print(f"  iteration {i:>3}        " + "  ".join(f"{kinds.get(k, 0.0):8.1f}" for k in STEP_KINDS))
    latest = run.get_bytes(LATEST).decode().strip() if run.exists(LATEST) else None
    print(f"workflow {result.name}: {result.phase} in {seconds:.0f}s {result.message}".rstrip())
    if latest:
        print(f"checkpoints: {run.url(CHECKPOINTS)}/ (LATEST = {latest})")
    print(f"report: {run.url(REPORT_MD_KEY)} and {run.url(REPORT_PNG_KEY)}")
    if cfg.tracking.tensorboard is not None and cfg.tracking.tensorboard.enabled:
        print(f"tensorboard: tensorboard --logdir {run.url(TENSORBOARD_PREFIX).removeprefix('file://')}")
    print(f"step logs: {result.run_dir}/pods/")


def demo_sft_settings(cfg: RunConfig, seed: int, arch: str = "qwen3_moe") -> SftSettings:
    """The demo SFT checkpoint a demo config starts from: its task, and for chat prompts a BPE tokenizer with a
    chat template (the checkpoint's own; nothing else in the run knows which tokenizer it is)."""
    from steps.demo.sft import SftSettings
    from steps.experience.rollout_plan import run_task

    task = run_task(cfg)
    chat = cfg.prompt_format == "chat"
    settings = SftSettings(
        task=task.name if task else SftSettings().task, seed=seed, tokenizer="bpe" if chat else "char",
        prompt_format=cfg.prompt_format, system_prompt=cfg.system_prompt,
        steps=DEMO_CHAT_SFT_STEPS if chat else SftSettings().steps, arch=arch,
    )  # fmt: skip
    if cfg.environment is None:
        return settings
    from steps.environments.conversation import EnvironmentSettings

    # a conversation with tools: the tools' schemas in the system prompt, two turns and the tool's answer
    return dataclasses.replace(
        settings, environment=EnvironmentSettings.from_config(cfg.environment), steps=DEMO_TOOL_SFT_STEPS,
        vocab_size=DEMO_TOOL_VOCAB_SIZE, max_positions=DEMO_TOOL_MAX_POSITIONS,
        stop_at_accuracy=DEMO_TOOL_SFT_STOP_AT, check_every=5, check_after=100,
    )  # fmt: skip


def demo(
    workdir: Path,
    iterations: int | None,
    seed: int | None,
    chaos: str | None,
    shards: int | None = None,
    config: Path = DEMO_CONFIG,
    arch: str = "qwen3_moe",
) -> RunResult:
    workdir = workdir.resolve()
    sft_dir = workdir / "sft-demo"
    overrides: dict[str, Any] = {"sft_checkpoint": str(sft_dir), "run_store": str(workdir / "run")}
    if iterations is not None:
        overrides["iterations"] = iterations
    if seed is not None:
        overrides["seed"] = seed
    if shards is not None:
        overrides["rollout.num_shards"] = shards
    # Check every flag before the SFT checkpoint is built: that takes minutes.
    cfg = load_config(config, overrides)
    parse_chaos(chaos)
    if not (sft_dir / "config.json").is_file():
        # Imported here: they load torch (6-12 s on a busy machine), which a demo with its SFT checkpoint skips.
        from pipelines.sft_demo import sft_demo

        sft_demo(str(sft_dir), demo_sft_settings(cfg, seed or 0, arch))
    else:
        built = json.loads((sft_dir / "config.json").read_text()).get("model_type")
        if built != arch:
            raise MoerlError(
                f"{sft_dir} holds a {built} demo checkpoint, not {arch}; pass --workdir for another or delete it"
            )
    if Store.open(cfg.run_store).exists(RUN_CONFIG):
        stored = Store.open(cfg.run_store).get_json(RUN_CONFIG)
        if stored != json.loads(cfg.model_dump_json()):
            raise MoerlError(
                f"{workdir}/run holds a run with other settings; pass a new --workdir or delete {workdir}/run"
            )
    start = time.monotonic()
    # No input checks here: the demo builds its own checkpoint for its own configs, and the checks' torch import
    # would cost the default demo ~2 s of its start; `moerl check` and `moerl run` check any config.
    result = run_config(cfg, workdir, chaos)
    print_summary(cfg, result, time.monotonic() - start)
    return result


def run_demo(args: argparse.Namespace) -> int:
    result = demo(
        Path(args.workdir), args.iterations, args.seed, args.chaos, args.shards, Path(args.config), args.arch
    )
    return 0 if result.succeeded else 1


def run_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    start = time.monotonic()
    result = run_config(cfg, Path(args.workdir).resolve(), args.chaos, check=args.config)
    print_summary(cfg, result, time.monotonic() - start)
    return 0 if result.succeeded else 1


def register(subparsers: argparse._SubParsersAction) -> None:
    chaos_help = (
        "inject faults: preempt=N[@TEMPLATE],kill=M[@TEMPLATE],seed=S (Spot preemptions and hard kills, aimed at "
        "one template's pods with @TEMPLATE; see docs/contracts.md)"
    )
    parser = subparsers.add_parser(
        "demo", help="run the RL workflow on this machine (CPU, file:// store)", description=__doc__
    )
    parser.add_argument("--config", default=str(DEMO_CONFIG),
                        help="demo config (default configs/demo.yaml; configs/demo-chat.yaml: BPE, chat template, "
                        "natural-language prompts, the math verifier)")  # fmt: skip
    parser.add_argument("--workdir", default="work/demo", help="where the SFT checkpoint, run store and logs go")
    parser.add_argument("--iterations", type=int, help="RL iterations (default: configs/demo.yaml)")
    parser.add_argument("--seed", type=int, help="seed of the SFT checkpoint and the run (default 0)")
    parser.add_argument("--shards", type=int, help="rollout shards (default: configs/demo.yaml)")
    parser.add_argument("--chaos", help=chaos_help)
    parser.add_argument("--arch", default="qwen3_moe",
                        help="the model family of the demo's SFT checkpoint, as `moerl sft-demo --arch` builds it "
                        "(default qwen3_moe; deepseek_v3: a tiny DeepSeek-V3)")  # fmt: skip
    parser.set_defaults(func=run_demo)

    parser = subparsers.add_parser("run", help="render a run config and run it here with the local executor")
    parser.add_argument("config", help="run config YAML")
    parser.add_argument("--workdir", default="work/run", help="where rendered manifests and step logs go")
    parser.add_argument("--chaos", help=chaos_help)
    parser.set_defaults(func=run_run)
