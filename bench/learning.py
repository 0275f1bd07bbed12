"""Learning benchmark: wall time to a held-out accuracy target, moerl against TRL's GRPOTrainer.

    .venv/bin/python bench/learning.py [--sft DIR] [--target ACC | --target-gain 0.15] [--time-limit 900]

Both sides start from the same SFT checkpoint (built with `moerl sft-demo` when --sft is missing), train on
the same task, prompts, reward and settings, all read from configs/demo.yaml at run time, and are judged by
the same held-out greedy accuracy (steps.scoring.evaluation.evaluate_accuracy on the config's held-out prompts):

    moerl  the real pipeline, `moerl demo --workdir DIR --iterations N`, as a user runs it (rollout shards,
           score, torchrun update, publish under the local executor). The accuracy of version v(i) is the
           heldout_accuracy that score[i+1] records in <run>/metrics/iter-(i+1).json; its time is when
           publish[i] wrote checkpoints/v(i)/MANIFEST.json.
    TRL    GRPOTrainer (transformers generate, HF Qwen3-MoE) in its own process, with a callback that
           evaluates after every iteration's worth of optimizer steps.

Clocks start when each side's process is launched (imports, model load and, for moerl, the workflow's plan
and import-sft steps count; the SFT build does not). Held-out evaluation time is taken off both clocks: the
TRL callback times its own evaluations; moerl's happen inside the score step, so each score step that
finished before publish[i] costs the `heldout_seconds` that its metrics record. The sides run one after the other, each
alone on the CPU budget (2 cores): moerl as its steps use them (2 rollout shards x 1 thread, score with
torch's default 2 threads, torchrun 2 ranks x 1 thread), TRL as one process with 2 torch threads.

A side that does not reach the target within --time-limit seconds (evaluation excluded) is stopped and
reported with its best accuracy and "not reached". The script prints a settings table, both times and the
ratio, and writes a PNG of held-out accuracy against seconds for both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelines.config import load_config  # noqa: E402
from steps.errors import MoerlError, run_cli  # noqa: E402
from steps.run.config import RunConfig  # noqa: E402
from steps.tracking.workflow_status import step_nodes  # noqa: E402

DEMO_CONFIG = REPO / "configs" / "demo.yaml"
CPU_CORES = 2
POLL_SECONDS = 1.0

# ----------------------------------------------------------------------------------------------------
# Settings: the moerl config, and the GRPOConfig fields that mean the same thing
# ----------------------------------------------------------------------------------------------------

# Trainer fields that change no arithmetic of a single-process run, or that TRL has no counterpart for.
TRAINER_NOT_MAPPED = {
    "ep_backend": "one process, no expert parallelism",
    "ep_size": "one process, no expert parallelism",
    "expert_placement": "one process holds every expert",
    "nproc_per_node": "one process (2 torch threads)",
    "nodes": "one process",
    "is_cap": "no importance correction without vLLM (both sides on-policy at staleness 0)",
    "is_correction": "no importance correction without vLLM (both sides on-policy at staleness 0)",
    "is_level": "no importance correction without vLLM (both sides on-policy at staleness 0)",
    "is_lower": "no importance correction without vLLM (both sides on-policy at staleness 0)",
    "old_logprobs": "recomputes them in an extra forward pass (steps_per_generation > 1): it has no engine log-probs",
    "shared_prompts": "runs each sample's prompt itself, and shuffles samples, not whole groups, into steps",
    "server": "one process that trains in place (a trainer that stays up changes where moerl trains, not what)",
    "server_wait_s": "one process, no trainer server to wait for",
    "server_idle_exit_s": "one process, no trainer job to end",
    "publish_wait_s": "no trainer that stays up, so none waits for a publish",
    "optimizer_after_answer": "no trainer that stays up there (when the optimizer state is stored, not what it is)",
    "activation_checkpointing": "memory, not arithmetic: the same update bit for bit (TRL: gradient_checkpointing)",
    "grouped_gemm": "how the experts' matmuls run, not what they compute (the same bits on the CPU)",
    "fsdp": "one process, nothing to shard over",
    "shard_experts": "one process, no replicas to shard the experts over",
    "sequence_packing": "how the forward lays the tokens out, not what it computes (the same log-probs to rounding)",
}
# Trainer fields mapped by grpo_settings.
TRAINER_MAPPED = {
    "micro_batch_size", "epochs", "steps_per_epoch", "lr", "weight_decay", "betas", "grad_clip", "clip_low",
    "clip_high", "loss_agg", "kl_coef", "warmup_steps", "warmup_iterations", "lr_schedule", "lr_final_ratio", "router",
    "router_aux_loss_coef", "loss", "routing_replay",
}  # fmt: skip
LR_SCHEDULES = {"constant": "constant", "linear": "linear", "cosine": "cosine"}


def demo_config(sft_dir: Path, run_store: Path, seed: int | None = None) -> RunConfig:
    """configs/demo.yaml as `moerl demo` resolves it, read now (the recipe may change between runs)."""
    overrides: dict[str, Any] = {"sft_checkpoint": str(sft_dir), "run_store": str(run_store)}
    if seed is not None:
        overrides["seed"] = seed
    return load_config(DEMO_CONFIG, overrides)


def unmapped_trainer_fields(cfg: RunConfig) -> list[str]:
    """Trainer fields the mapping does not know: a recipe change the TRL side would silently miss."""
    return sorted(set(type(cfg.trainer).model_fields) - TRAINER_MAPPED - set(TRAINER_NOT_MAPPED))


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, max(cap, 1)) + 1) if n % d == 0)


def grpo_settings(cfg: RunConfig, iterations: int, output_dir: str) -> dict[str, Any]:
    """GRPOConfig keyword arguments that train as the moerl run config does, for `iterations` iterations.

    One moerl iteration = one TRL generation batch: prompts_per_iteration prompts x group_size samples,
    trained for epochs x steps_per_epoch optimizer steps of (samples / steps_per_epoch) sequences each.
    TRL cuts that mini-batch into gradient-accumulation micro-batches of the sequences moerl puts through
    one forward pass on all its ranks (micro_batch_size x ranks), which changes memory, not the update.
    """
    if cfg.task is None or cfg.prompt_file is not None:
        raise MoerlError("the learning bench needs a built-in task in the config (task:), not a prompt_file")
    if cfg.rewards.reward_model:
        raise MoerlError("the learning bench maps the rule verifiers only; remove rewards.reward_model")
    t = cfg.trainer
    samples = cfg.prompts_per_iteration * cfg.group_size
    if samples % t.steps_per_epoch:
        raise MoerlError(
            f"{samples} samples per iteration do not split into trainer.steps_per_epoch={t.steps_per_epoch} equal "
            "mini-batches, which TRL needs; pick a steps_per_epoch that divides prompts_per_iteration x group_size"
        )
    mini_batch = samples // t.steps_per_epoch
    micro_batch = _largest_divisor_at_most(mini_batch, t.micro_batch_size * t.nproc_per_node * t.nodes)
    steps_per_iteration = t.epochs * t.steps_per_epoch
    warmup = int(getattr(t, "warmup_steps", 0) or 0)
    warmup += steps_per_iteration * int(getattr(t, "warmup_iterations", 0) or 0)
    schedule = LR_SCHEDULES.get(str(getattr(t, "lr_schedule", "constant") or "constant"))
    if schedule is None:
        raise MoerlError(f"trainer.lr_schedule {t.lr_schedule!r} has no TRL counterpart in bench/learning.py")
    if schedule == "constant" and warmup:
        schedule = "constant_with_warmup"
    if getattr(t, "loss", "ppo") != "ppo":
        raise MoerlError(f"trainer.loss {t.loss!r}: the learning bench compares PPO-clip only (TRL's GRPOTrainer "
                         "loss); set trainer.loss: ppo")  # fmt: skip
    if getattr(t, "routing_replay", "none") != "none":  # TRL's trainer always routes with its own routers
        raise MoerlError("trainer.routing_replay: TRL's GRPOTrainer has no routing replay; set it to none")
    if getattr(cfg.rollout, "dynamic_sampling", False):  # TRL generates one batch an iteration and trains on it all
        raise MoerlError("rollout.dynamic_sampling: TRL's GRPOTrainer has no dynamic sampling; set it to false")
    scheduler_kwargs: dict[str, float] = {}
    final = float(getattr(t, "lr_final_ratio", 0.0) or 0.0)
    if schedule == "cosine" and final > 0:  # transformers' cosine down to a floor: min_lr_rate
        schedule, scheduler_kwargs = "cosine_with_min_lr", {"min_lr_rate": final}
    elif schedule == "linear" and final > 0:
        raise MoerlError("trainer.lr_schedule linear with lr_final_ratio > 0 has no TRL counterpart (its linear "
                         "schedule ends at 0); use cosine, or lr_final_ratio 0")  # fmt: skip
    s = cfg.sampling
    return dict(
        output_dir=output_dir,
        # what is sampled
        num_generations=cfg.group_size,
        generation_batch_size=samples,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        shuffle_dataset=False,  # the dataset is moerl's prompt stream, iteration after iteration
        # how it is trained
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=mini_batch // micro_batch,
        num_iterations=t.epochs,
        max_steps=iterations * steps_per_iteration,
        learning_rate=t.lr,
        lr_scheduler_type=schedule,
        lr_scheduler_kwargs=scheduler_kwargs,
        warmup_steps=warmup,
        optim="adamw_torch",
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        epsilon=t.clip_low,
        epsilon_high=t.clip_high,
        loss_type={"token-mean": "dapo", "seq-mean": "grpo"}[t.loss_agg],
        beta=t.kl_coef,
        scale_rewards="group" if cfg.rewards.normalize_std else "none",
        router_aux_loss_coef=t.router_aux_loss_coef,  # the routers' load-balancing loss (0: none, as moerl's default)
        seed=cfg.seed,
        # plain fp32 CPU training, as moerl's; TRL's defaults are bf16 and gradient checkpointing
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=steps_per_iteration,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def settings_rows(cfg: RunConfig, grpo: dict[str, Any], iterations: int) -> list[tuple[str, str, str]]:
    """(setting, moerl, TRL) rows for the side-by-side table."""
    t, s = cfg.trainer, cfg.sampling
    samples = cfg.prompts_per_iteration * cfg.group_size
    trl_steps = grpo["max_steps"] // iterations
    rows = [
        ("task / held-out prompts", f"{cfg.task.name} / {cfg.heldout_size}", f"{cfg.task.name} / {cfg.heldout_size}"),
        ("prompts x samples per iteration", f"{cfg.prompts_per_iteration} x {cfg.group_size}",
         f"{grpo['generation_batch_size'] // grpo['num_generations']} x {grpo['num_generations']}"),
        ("temperature / top_p / top_k", f"{s.temperature} / {s.top_p} / {s.top_k}",
         f"{grpo['temperature']} / {grpo['top_p']} / {grpo['top_k']}"),
        ("max new tokens", str(s.max_new_tokens), str(grpo["max_completion_length"])),
        ("reward", f"{cfg.rewards.exact_match_weight} exact + {cfg.rewards.format_weight} format",
         "same verifier (steps.data.tasks), same weights"),
        ("advantage", "group mean" + (", / group std (ddof 0)" if cfg.rewards.normalize_std else ""),
         f"scale_rewards={grpo['scale_rewards']} (std ddof 1)"),
        ("optimizer steps per iteration", f"{t.epochs} epochs x {t.steps_per_epoch} steps",
         f"num_iterations {grpo['num_iterations']} x {trl_steps // grpo['num_iterations']}"),
        ("sequences per optimizer step", str(samples // t.steps_per_epoch),
         f"{grpo['per_device_train_batch_size']} x {grpo['gradient_accumulation_steps']} accumulation"),
        ("learning rate / schedule / warmup", f"{t.lr} / {getattr(t, 'lr_schedule', 'constant')} / "
         f"{getattr(t, 'warmup_steps', 0) or 0} steps + {getattr(t, 'warmup_iterations', 0) or 0} iterations",
         f"{grpo['learning_rate']} / {grpo['lr_scheduler_type']} / {grpo['warmup_steps']} steps"),
        ("AdamW betas / weight decay", f"{tuple(t.betas)} / {t.weight_decay}",
         f"({grpo['adam_beta1']}, {grpo['adam_beta2']}) / {grpo['weight_decay']}"),
        ("grad clip", str(t.grad_clip), str(grpo["max_grad_norm"])),
        ("clip low / high", f"{t.clip_low} / {t.clip_high}", f"{grpo['epsilon']} / {grpo['epsilon_high']}"),
        ("loss aggregation", t.loss_agg, f"loss_type={grpo['loss_type']}"),
        ("KL coefficient", str(t.kl_coef), f"beta={grpo['beta']}"),
        ("staleness", str(cfg.staleness), "0 (synchronous)"),
        ("seed", str(cfg.seed), str(grpo["seed"])),
        ("generation engine", f"{cfg.rollout.engine}, {cfg.rollout.num_shards} shards x 1 thread",
         "transformers generate, 2 threads"),
        ("trainer", f"torchrun {t.nproc_per_node} ranks x 1 thread, EP {t.ep_backend}",
         "1 process, 2 threads, fp32"),
    ]  # fmt: skip
    rows += [(f"trainer.{name}", str(getattr(t, name)), "NOT MAPPED") for name in unmapped_trainer_fields(cfg)]
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    header = ("setting", "moerl", "TRL GRPOTrainer")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Curves
# ----------------------------------------------------------------------------------------------------


@dataclass
class Curve:
    """Held-out accuracy against seconds since the side's launch, evaluation time excluded."""

    name: str
    points: list[tuple[float, float]] = field(default_factory=list)  # (seconds, accuracy), by time
    iteration_seconds: list[float] = field(default_factory=list)  # training time of each iteration
    note: str = ""
    cpu_seconds: float | None = None  # CPU time of the side's processes, all of them
    load: tuple[float, float] | None = None  # the machine's 1-minute load average at the side's start and end

    def time_to(self, target: float) -> float | None:
        return time_to_target(self.points, target)

    @property
    def best(self) -> float | None:
        return max((a for _, a in self.points), default=None)


def time_to_target(points: list[tuple[float, float]], target: float) -> float | None:
    """Seconds of the first point whose accuracy reaches target (points in time order), None if none does."""
    for seconds, accuracy in sorted(points):
        if accuracy >= target - 1e-12:
            return seconds
    return None


def moerl_curve(
    start: float,
    published: dict[int, float],
    heldout: dict[int, float],
    score_finished: dict[int, float],
    eval_seconds: dict[int, float],
) -> Curve:
    """moerl's points from wall-clock stamps (epoch seconds).

    published: version i -> when publish[i] finished (v0: anything; it is placed at 0 s).
    heldout: version -> its held-out accuracy (score[i+1] evaluates v(i) at staleness 0).
    score_finished / eval_seconds: iteration j -> when score[j] finished / how long its evaluation took.
    The evaluations that finished before a version was published are taken off that version's time.
    """
    points, times = [], {}
    for version in sorted(heldout):
        if version == 0:
            times[0] = 0.0
        elif version in published:
            spent = sum(eval_seconds.get(j, 0.0) for j, t in score_finished.items() if t <= published[version])
            times[version] = published[version] - start - spent
        else:
            continue
        points.append((times[version], heldout[version]))
    ordered = sorted(times)
    steps = [times[b] - times[a] for a, b in zip(ordered, ordered[1:], strict=False) if b == a + 1 and a > 0]
    return Curve("moerl", sorted(points), steps)


# ----------------------------------------------------------------------------------------------------
# moerl: `moerl demo` in a subprocess, watched through its run store
# ----------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def status_times(status: dict[str, Any], kind: str) -> dict[int, float]:
    """iteration -> finishedAt of the `kind-I` node that succeeded, from Argo-shaped status."""
    return {
        node.iteration: node.finished.timestamp()
        for node in step_nodes(status)
        if node.step == kind and node.iteration is not None and not node.attempt and node.phase == "Succeeded"
        and node.finished is not None
    }  # fmt: skip


def run_moerl(args: argparse.Namespace, cfg: RunConfig, sft_dir: Path, target: float) -> Curve:
    workdir = Path(args.workdir) / "moerl"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    shutil.copytree(sft_dir, workdir / "sft-demo")  # `moerl demo` finds it and builds nothing
    run = workdir / "run"
    moerl = Path(sys.executable).with_name("moerl")
    command = [str(moerl), "demo", "--workdir", str(workdir), "--iterations", str(args.iterations)]
    command += ["--seed", str(cfg.seed)]  # the run's seed (the SFT checkpoint is given: nothing is built)
    print(f"moerl: {' '.join(command)}  (each score step's heldout_seconds taken off the clock)")
    log = (workdir / "moerl-demo.log").open("w")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    load = os.getloadavg()[0]
    cpu = _children_cpu_seconds()
    start = time.time()
    # SIGINT back to its default in the child: a bench started in the background (`... &`) inherits it
    # ignored, and then stop_workflow's Ctrl-C would not reach the executor
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    published: dict[int, float] = {}
    evals: dict[int, float] = {}  # iteration -> its score step's held-out evaluation seconds
    curve = Curve("moerl")

    def observe() -> Curve:
        for manifest in (run / "checkpoints").glob("v*/MANIFEST.json"):
            version = int(manifest.parent.name[1:])
            if version not in published:
                published[version] = manifest.stat().st_mtime
        heldout = {}
        for path in (run / "metrics").glob("iter-*[0-9].json"):
            metrics = _read_json(path) or {}
            if "heldout_accuracy" in metrics:
                heldout[int(metrics["policy_version"])] = float(metrics["heldout_accuracy"])
                evals[int(metrics["iteration"])] = float(metrics["heldout_seconds"])
        status = _read_json(workdir / "status.json") or {}
        for version, finished in status_times(status, "publish").items():
            published.setdefault(version, finished)
        return moerl_curve(start, published, heldout, status_times(status, "score"), evals)

    stopped = ""
    while proc.poll() is None:
        time.sleep(POLL_SECONDS)
        curve = observe()
        clock = time.time() - start - sum(evals.values())
        if curve.time_to(target) is not None and not args.keep_going:
            stopped = "target reached"
        elif clock > args.time_limit:
            stopped = "time limit"
        if stopped:
            stop_workflow(proc)
            break
    log.close()
    curve = observe()
    if proc.returncode not in (0, None) and not stopped:
        tail = (workdir / "moerl-demo.log").read_text()[-3000:]
        raise MoerlError(f"moerl demo failed (exit {proc.returncode}); its log ends:\n{tail}")
    curve.note = stopped or "workflow finished"
    curve.cpu_seconds = _children_cpu_seconds() - cpu  # pods are waited for by the executor: they count
    curve.load = (load, os.getloadavg()[0])
    return curve


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def stop_workflow(proc: subprocess.Popen) -> None:
    """Ctrl-C the local executor: it stops its pods (each in its own session) and writes its status."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------------------------------
# TRL: GRPOTrainer in a worker process (python bench/learning.py --trl-worker SPEC.json)
# ----------------------------------------------------------------------------------------------------


class VerifierReward:
    """moerl's reward as a TRL reward function: the task verifier's (correct, well_formed), weighted as
    steps/scoring/rewards.py combines them. completion_ids end at the first <eos> (TRL keeps it), as moerl's do."""

    __name__ = "verifier"

    def __init__(self, cfg: RunConfig) -> None:
        from steps.demo.sft import char_checkpoint_tokenizer
        from steps.scoring.rewards import RewardWeights

        self.weights = RewardWeights.from_config(cfg.rewards)  # no reward model or function: their weights stay unused
        self.tok = char_checkpoint_tokenizer()  # the demo checkpoint's own

    def __call__(self, prompts: list, completions: list, completion_ids: list, task: list, answer: list,
                 **_: Any) -> list[float]:  # fmt: skip
        from steps.scoring.rewards import combine, verify_samples

        correct, well_formed = verify_samples(self.tok, task, answer, completion_ids)
        return [float(r) for r in combine(correct, well_formed, None, self.weights)]


def prompt_dataset(cfg: RunConfig, iterations: int) -> dict[str, list[str]]:
    """moerl's training prompts, iteration after iteration, as dataset columns."""
    from steps.experience.rollout_plan import iteration_prompts

    prompts = [p for i in range(1, iterations + 1) for p in iteration_prompts(cfg, i)]
    return {
        "prompt": [p.text for p in prompts],
        "answer": [p.answer for p in prompts],
        "task": [p.task for p in prompts],
        "prompt_id": [p.prompt_id for p in prompts],
    }


def trl_worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    start = float(spec["start"])
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from steps.data.tokenizer import CheckpointTokenizer
    from steps.engines.torch_engine import TorchEngine
    from steps.experience.rollout_plan import heldout_prompts
    from steps.run.config import RunConfig
    from steps.scoring.evaluation import evaluate_accuracy

    cfg = RunConfig.model_validate(spec["config"])
    heldout = heldout_prompts(cfg)
    steps_per_iteration = cfg.trainer.epochs * cfg.trainer.steps_per_epoch
    grpo = GRPOConfig(**grpo_settings(cfg, spec["iterations"], spec["output_dir"]))
    model_kwargs = {"dtype": torch.float32}
    if spec.get("experts_implementation"):
        model_kwargs["experts_implementation"] = spec["experts_implementation"]
    model = AutoModelForCausalLM.from_pretrained(spec["sft"], local_files_only=True, **model_kwargs)
    if cfg.trainer.router == "freeze":  # as moerl's update: the routers keep their SFT weights
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(spec["sft"], local_files_only=True)
    # save_pretrained writes the weights only: the held-out evaluation reads the SFT checkpoint's tokenizer.
    eval_tokenizer = CheckpointTokenizer.load(spec["sft"])
    result: dict[str, Any] = {"points": [], "iteration_seconds": [], "eval_seconds": 0.0}

    def save() -> None:
        result["cpu_seconds"] = time.process_time()
        Path(spec["out"]).write_text(json.dumps(result))

    class HeldOut(TrainerCallback):
        """Evaluate after every iteration's optimizer steps; the evaluation's own time is off the clock."""

        last = None

        def evaluate(self, state: Any, control: Any) -> None:
            began = time.time()
            clock = began - start - result["eval_seconds"]
            with tempfile.TemporaryDirectory(prefix="moerl-bench-trl-") as tmp:
                model.save_pretrained(tmp)  # per-expert tensor names, which steps.models.qwen3_moe loads
                accuracy = evaluate_accuracy(TorchEngine.from_checkpoint(tmp), eval_tokenizer, heldout,
                                             max_new_tokens=cfg.sampling.max_new_tokens)  # fmt: skip
            model.train()
            result["eval_seconds"] += time.time() - began
            result["points"].append([clock, accuracy])
            if self.last is not None:
                result["iteration_seconds"].append(clock - self.last)
            self.last = clock
            print(f"trl step {state.global_step}: {clock:.1f} s, held-out accuracy {accuracy:.4f}", flush=True)
            if (accuracy >= spec["target"] and not spec["keep_going"]) or clock > spec["time_limit"]:
                result["stopped"] = "target reached" if accuracy >= spec["target"] else "time limit"
                control.should_training_stop = True
            save()

        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.evaluate(state, control)

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if state.global_step % steps_per_iteration == 0:
                self.evaluate(state, control)

    trainer = GRPOTrainer(
        model=model, reward_funcs=VerifierReward(cfg), args=grpo,
        train_dataset=Dataset.from_dict(prompt_dataset(cfg, spec["iterations"])),
        processing_class=tokenizer, callbacks=[HeldOut()],
    )  # fmt: skip
    trainer.train()
    result.setdefault("stopped", "all iterations done")
    save()
    return 0


def run_trl(args: argparse.Namespace, cfg: RunConfig, sft_dir: Path, target: float) -> Curve:
    workdir = Path(args.workdir) / "trl"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    spec = {
        "config": cfg.model_dump(mode="json"), "sft": str(sft_dir), "iterations": args.iterations,
        "target": target, "time_limit": args.time_limit, "keep_going": args.keep_going, "threads": CPU_CORES,
        "output_dir": str(workdir / "out"), "out": str(workdir / "curve.json"),
        "experts_implementation": args.trl_experts_implementation,
    }  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_DISABLED": "true", "TOKENIZERS_PARALLELISM": "false"}
    log_path = workdir / "trl.log"
    load = os.getloadavg()[0]
    cpu = _children_cpu_seconds()
    spec["start"] = time.time()
    (workdir / "spec.json").write_text(json.dumps(spec))
    print(f"TRL: {sys.executable} bench/learning.py --trl-worker {workdir / 'spec.json'}  (log {log_path})")
    with log_path.open("w") as log:
        code = subprocess.call([sys.executable, __file__, "--trl-worker", str(workdir / "spec.json")],
                               cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    result = _read_json(workdir / "curve.json")
    if code != 0 or result is None:
        raise MoerlError(f"the TRL worker failed (exit {code}); its log ends:\n{log_path.read_text()[-3000:]}")
    points = [(float(t), float(a)) for t, a in result["points"]]
    points[0] = (0.0, points[0][1])  # the SFT checkpoint, as on the moerl side
    curve = Curve("TRL GRPOTrainer", points, [float(s) for s in result["iteration_seconds"]])
    curve.note = result.get("stopped", "")
    curve.cpu_seconds = _children_cpu_seconds() - cpu
    curve.load = (load, os.getloadavg()[0])
    return curve


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def summary_line(curve: Curve, target: float) -> str:
    reached = curve.time_to(target)
    best = f"best {curve.best:.3f}" if curve.best is not None else "no evaluation"
    per_iter = sorted(curve.iteration_seconds)
    median = f", {per_iter[len(per_iter) // 2]:.1f} s per iteration (median of {len(per_iter)})" if per_iter else ""
    when = f"{reached:.1f} s" if reached is not None else "not reached"
    cpu = f"; {curve.cpu_seconds:.0f} CPU s" if curve.cpu_seconds is not None else ""
    load = f"; load {curve.load[0]:.1f} -> {curve.load[1]:.1f}" if curve.load else ""
    return f"{curve.name:>16}: {when:>12}  ({best}{median}; {curve.note}{cpu}{load})"


def plot(curves: list[Curve], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for curve in curves:
        xs, ys = zip(*curve.points, strict=True) if curve.points else ((), ())
        ax.plot(xs, ys, marker="o", markersize=3, label=curve.name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    ax.set_xlabel("wall-clock seconds (held-out evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("demo task: moerl vs TRL GRPOTrainer, same SFT checkpoint and settings")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sft_accuracy(cfg: RunConfig, sft_dir: Path) -> float:
    from steps.data.tokenizer import CheckpointTokenizer
    from steps.engines.torch_engine import TorchEngine
    from steps.experience.rollout_plan import heldout_prompts
    from steps.scoring.evaluation import evaluate_accuracy

    engine = TorchEngine.from_checkpoint(sft_dir)
    tok = CheckpointTokenizer.load(sft_dir)
    return evaluate_accuracy(engine, tok, heldout_prompts(cfg), max_new_tokens=cfg.sampling.max_new_tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", help="the demo SFT checkpoint dir (default: WORKDIR/sft-demo, built if missing)")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "moerl-bench-learning"),
                        help="scratch dir of both runs (its moerl/ and trl/ are replaced)")  # fmt: skip
    parser.add_argument("--target", type=float, help="absolute held-out accuracy target, e.g. 0.7")
    parser.add_argument("--target-gain", type=float, default=0.15,
                        help="target = the SFT checkpoint's held-out accuracy + this (default 0.15)")  # fmt: skip
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds per side, evaluation excluded")
    parser.add_argument("--iterations", type=int,
                        help="iterations each side may run (moerl demo --iterations; TRL max_steps); default: the "
                        "config's segment_size, so that moerl runs one Workflow")  # fmt: skip
    parser.add_argument("--keep-going", action="store_true", help="run to the time limit after the target")
    parser.add_argument("--sides", default="moerl,trl", help="which sides to run (default moerl,trl)")
    parser.add_argument("--seed", type=int, help="the run seed of both sides (default: configs/demo.yaml's)")
    parser.add_argument(
        "--trl-experts-implementation",
        default=None,
        help="transformers experts_implementation for TRL's model (default: transformers')",
    )
    parser.add_argument("--png", default="learning.png", help="where the accuracy-vs-seconds plot goes")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)

    import torch

    torch.set_num_threads(CPU_CORES)
    workdir = Path(args.workdir)
    sft_dir = Path(args.sft) if args.sft else workdir / "sft-demo"
    cfg = demo_config(sft_dir, workdir / "moerl" / "run", args.seed)
    args.iterations = args.iterations or cfg.segment_size
    if not (sft_dir / "config.json").is_file():
        from pipelines.sft_demo import sft_demo
        from steps.demo.sft import SftSettings

        print(f"building the SFT checkpoint in {sft_dir} (not timed)")
        sft_demo(str(sft_dir), SftSettings(seed=cfg.seed))
    base = sft_accuracy(cfg, sft_dir)
    target = args.target if args.target is not None else base + args.target_gain
    grpo = grpo_settings(cfg, args.iterations, str(workdir / "trl" / "out"))
    print(f"SFT checkpoint {sft_dir}: held-out accuracy {base:.3f}; target {target:.3f}; "
          f"time limit {args.time_limit:.0f} s per side, up to {args.iterations} iterations\n")  # fmt: skip
    print(format_table(settings_rows(cfg, grpo, args.iterations)) + "\n")
    if unmapped_trainer_fields(cfg):
        print(f"warning: not mapped to TRL: {', '.join(unmapped_trainer_fields(cfg))}\n")

    curves = []
    sides = {s.strip() for s in args.sides.split(",")}
    if "moerl" in sides:
        curves.append(run_moerl(args, cfg, sft_dir, target))
        print(summary_line(curves[-1], target))
    if "trl" in sides:
        curves.append(run_trl(args, cfg, sft_dir, target))
        print(summary_line(curves[-1], target))

    print(f"\ntime to held-out accuracy {target:.3f} (evaluation excluded), machine load {os.getloadavg()[0]:.1f}:")
    for curve in curves:
        print(summary_line(curve, target))
        print("    " + "  ".join(f"{t:.0f}s:{a:.3f}" for t, a in curve.points))
    times = [c.time_to(target) for c in curves]
    if len(curves) == 2 and all(t is not None for t in times):
        ratio = times[1] / times[0] if times[0] > 0 else math.inf
        print(f"moerl reaches the target {ratio:.2f}x sooner than TRL (target: at least 2x)")
    elif len(curves) == 2:
        print("ratio: n/a (a side did not reach the target within the time limit)")
    plot(curves, target, Path(args.png))
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    run_cli(main)
