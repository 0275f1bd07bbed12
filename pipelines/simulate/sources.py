"""Where each of the simulator's assumptions comes from (`moerl simulate --explain`): a published measurement, a
figure measured on this machine, arithmetic from the config, or an assumption, said as such, with the nearest
published figure beside it where one exists. No value here is chosen to meet a target; one whose source is only
"assumption" is what a GPU measurement (bench/gpu_smoke.py) or a published figure for the same model and hardware
should replace.

The published figures cited (their conditions in bench/README.md, "Where the simulator's rates come from"):
  LMSYS-EP     LMSYS, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 H100 GPUs"
               (2025-05-05): DeepSeek-V3 decode 22,282 output tokens/s a node of 8 H100 (EP72, FP8, 256 sequences a
               GPU, 2,000 tokens of context)
  MB-PERF      NVIDIA-NeMo/Megatron-Bridge docs/performance-summary(-archive).md @067f987: Qwen3-30B-A3B on 16 H100,
               203 model TFLOP/s a GPU, 8,826 tokens/s a GPU (FP8, EP16, seq 4096); Qwen3-235B-A22B on 256 H100,
               253 TFLOP/s, 1,712 tokens/s a GPU (FP8, TP2 PP8 EP32)
  NEMO-RL      NVIDIA-NeMo/RL docs/about/performance-summary.md (v0.6.0): GRPO step times and tokens/s a GPU
  SLIME-SYNC   "Efficient RL Training - Optimizing Weight Sync in slime": Qwen3-30B-A3B update_weights_from_tensor
               60 s -> 7 s on 8 H100; THUDM/slime PR #67: Qwen3-235B 8 min -> 1 min
  NEMO-REFIT   NeMo-RL blog 2025-08-12 "refit performance": DeepSeek-V3 refit 692.5 s -> 47.2 s (vLLM)
  MB-BF16      NVIDIA-NeMo/Megatron-Bridge examples/model_verification_cards/qwen3-30b-a3b/card.yaml @067f987:
               Qwen3-30B-A3B on 16 H100 in BF16 (EP16, seq 4096, real data, natural routing): 199 model TFLOP/s,
               8,655 tokens/s a GPU
  S3-PERF      AWS S3 user guide, "Performance design patterns for Amazon S3": one concurrent request for each
               85-90 MB/s wanted, about 15 to saturate a 10 Gb/s NIC, more for 25 or 100 Gb/s ones
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import yaml

from pipelines.simulate.sizing import Assumptions
from steps.errors import MoerlError

ASSUMPTION = "assumption"

GPU_SOURCES: dict[str, str] = {
    "rollout_tokens_per_gpu_s": f"{ASSUMPTION}: SGLang decode of a ~3B-active MoE a GPU at hundreds of sequences "
    "(no bf16 figure for Qwen3-30B-A3B on H100/H200 is published; LMSYS-EP: DeepSeek-V3 in FP8 decodes 2,785 a "
    "H100 over EP72)",
    "trainer_tokens_per_gpu_s": f"{ASSUMPTION}: ~100 model TFLOP/s a GPU over ~2.6e10 FLOPs a token (MB-BF16: "
    "Megatron-Bridge reaches 199 TFLOP/s, 8,655 tokens/s a GPU, for Qwen3-30B-A3B on H100 in BF16; MB-PERF: 203 in "
    "FP8; moerl's bf16 trainer is not measured on a GPU yet)",
    "engine_startup_s": f"{ASSUMPTION}: the checkpoint from S3 at s3_gb_per_s, SGLang start-up, DeepEP buffers, "
    "CUDA graphs",
    "trainer_startup_s": f"{ASSUMPTION}: rendezvous, NCCL/DeepEP init, weights and AdamW state per rank",
    "pod_start_s": f"{ASSUMPTION}: Argo schedules the pod and its container starts on a warm node",
    "step_startup_s": f"{ASSUMPTION}: Python, the torch import and run.json",
    "score_samples_per_s": f"{ASSUMPTION}: rule verifiers on a CPU pod",
    "import_sft_s": f"{ASSUMPTION}: a copy of the checkpoint inside S3",
    "publish_s": f"{ASSUMPTION}: server-side digests and copies of the weights and optimizer state on S3",
    "report_s": f"{ASSUMPTION}: the metrics table and the PNG",
    "node_replacement_s": f"{ASSUMPTION}: Karpenter launches a p5en Spot node, it joins and pulls the image",
    "response_fill": f"{ASSUMPTION}: every response (with an environment: every model turn) at max_new_tokens "
    "(--from-run takes a run's; NEMO-RL's Qwen3-30B-A3B runs average 3,203 of 4,096)",
    "rollout_nodes": "the config: one node a rollout shard",
    "checkpoint_gb": "arithmetic: the model's tensors in its dtype (Qwen3-30B-A3B without a readable config.json)",
    "optimizer_gb": "arithmetic: 12 bytes a parameter (fp32 masters and two AdamW moments)",
    "s3_gb_per_s": f"{ASSUMPTION}: 1 GB/s a node, read or write (S3-PERF: 85-90 MB/s a concurrent request; the run "
    "store's uploads send 10 parts of a file at once, its downloads one request an object)",
    "nvme_gb_per_s": f"{ASSUMPTION}: one NVMe drive's sequential read",
    "engine_update_s": f"{ASSUMPTION}: SGLang's update_weights_from_disk beyond reading the files (SLIME-SYNC: 7 s "
    "for Qwen3-30B-A3B from tensors; NEMO-REFIT: 47 s for DeepSeek-V3)",
    "delta_fraction": "measured: bench/weight_update.py on the demo's versions",
    "delta_encode_gb_per_s": "measured: bench/weight_update.py's delta encoder on one thread, 48 bf16 tensors of "
    "768 x 2048 (Qwen3-30B-A3B's expert projections)",
    "delta_encode_speedup": f"{ASSUMPTION}: a p5en writer's 24 threads (192 vCPUs / 8 ranks: encode_threads) on 12 "
    "cores, at the 84% a core bench/weight_update.py measures on this machine's 2 (1.67x)",
    "replicated_fraction": "arithmetic: the model's parameters outside the routed experts",
    "num_experts": "the model's config.json",
    "prompt_tokens": f"{ASSUMPTION}: a prompt's tokens beside its response (--from-run takes a run's)",
    "gpu_memory_gb": "the trainer's instance type (0: from it)",
    "tied_group_share": f"{ASSUMPTION}: late in the demos 40-55% of groups tied (bench/README.md); --from-run "
    "takes a run's",
    # A config with an environment (multi-turn rollouts); ignored without one.
    "turns": f"{ASSUMPTION}: 0 stands for the config's environment.max_turns, every conversation running to its "
    "turn limit (at most that); --from-run takes a run's turns_mean",
    "environment_step_s": f"{ASSUMPTION}: one environment step, 0.05 s; --from-run does not measure it (no step of "
    "a run times it): time your environment's step (reset it, then step it on a typical model turn) and --assume "
    "environment_step_s=SECONDS",
    "observation_tokens": f"{ASSUMPTION}: an observation (a tool's answer as the chat template renders it) of 32 "
    "tokens; --from-run takes a run's (response_length_mean - model_tokens_mean) / max(turns_mean - 1, 1)",
}
# What the `turns` source reads where the config has an environment (and turns is the default) or none.
TURNS_FROM_CONFIG = (f"{ASSUMPTION}: the config's environment.max_turns, every conversation running to its turn "
                     "limit; --from-run takes a run's turns_mean")  # fmt: skip
TURNS_IGNORED = "not used: the config has no environment (every sample is one model turn)"
CPU_SOURCES: dict[str, str] = {
    **{name: "measured on this machine (2 cores, the demo model; pipelines/simulate/sizing.py CPU_ASSUMPTIONS)"
       for name in GPU_SOURCES},  # fmt: skip
    "response_fill": GPU_SOURCES["response_fill"],
    "prompt_tokens": GPU_SOURCES["prompt_tokens"],
    "tied_group_share": GPU_SOURCES["tied_group_share"],
    "rollout_nodes": GPU_SOURCES["rollout_nodes"],
    "gpu_memory_gb": GPU_SOURCES["gpu_memory_gb"],
    "turns": GPU_SOURCES["turns"],
    "environment_step_s": GPU_SOURCES["environment_step_s"],
    "observation_tokens": GPU_SOURCES["observation_tokens"],
}
# What model_assumptions moves from the reference model to the checkpoint's (pipelines/simulate/sizing.py).
MOVED_TO_THE_MODEL = {
    "rollout_tokens_per_gpu_s": "scaled by the reference's compute parameters / the model's",
    "trainer_tokens_per_gpu_s": "scaled by the reference's training FLOPs a token / the model's",
    "engine_startup_s": "plus the model's extra checkpoint bytes at s3_gb_per_s",
    "import_sft_s": "scaled by the model's checkpoint bytes",
    "publish_s": "scaled by the model's checkpoint and optimizer bytes",
    "checkpoint_gb": "the model's tensors in its dtype",
    "optimizer_gb": "the model's parameters x 12 bytes",
    "replicated_fraction": "the model's parameters outside the routed experts",
    "num_experts": "the model's config.json",
}


def explain_lines(a: Assumptions, sources: dict[str, str]) -> list[str]:
    """Every assumption with its value and source, unsourced ones marked as assumptions."""
    lines = ["assumptions (moerl simulate --explain; `assumption` marks a value no measurement or publication gives):"]
    for field in dataclasses.fields(Assumptions):
        value = getattr(a, field.name)
        shown = f"{value:,.4g}" if isinstance(value, float) else f"{value:,}"
        lines.append(f"  {field.name:<26} {shown:>10}  {sources.get(field.name, ASSUMPTION)}")
    return lines


# ----------------------------------------------------------------------------------------------- stated

STATED_SUFFIX = ".assumptions.yaml"  # beside a config: configs/eks-p5en.yaml -> configs/eks-p5en.assumptions.yaml
STATED_KINDS = ("published", "measured", "arithmetic", ASSUMPTION)


def stated_path(config: Path) -> Path:
    """Where a config's own assumptions live: beside it, the same name ending in .assumptions.yaml."""
    return config.with_name(config.name.removesuffix(".yaml").removesuffix(".yml") + STATED_SUFFIX)


def read_stated(path: Path) -> tuple[dict[str, float], dict[str, str]]:
    """A config's stated assumptions ({name: {value, source}}): what its workload is known to be (for example the
    mean response length a peer published for the same model and cap), each with its source, which must start
    with what kind it is (published, measured, arithmetic or assumption). Returns (values, sources); refuses an
    unknown name, a value that is not a number >= 0, or a source that does not say its kind."""
    names = {f.name for f in dataclasses.fields(Assumptions)}
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise MoerlError(f"{path}: not readable as YAML ({err})") from None
    if not isinstance(data, dict) or not data:
        raise MoerlError(f"{path}: expected a mapping of assumption names to {{value, source}}")
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for name, entry in data.items():
        if name not in names:
            raise MoerlError(f"{path}: {name!r} is not an assumption (known: {', '.join(sorted(names))})")
        if not isinstance(entry, dict) or set(entry) != {"value", "source"}:
            raise MoerlError(f"{path}: {name}: expected {{value: NUMBER, source: TEXT}}, got {entry!r}")
        value, source = entry["value"], entry["source"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise MoerlError(f"{path}: {name}: value {value!r} is not a finite number >= 0")
        if not isinstance(source, str) or not source.strip().startswith(STATED_KINDS):
            raise MoerlError(
                f"{path}: {name}: the source must start with what it is ({', '.join(STATED_KINDS)}: ...), "
                f"got {source!r}"
            )
        values[name] = int(value) if name == "rollout_nodes" else float(value)
        sources[name] = f"{' '.join(source.split())} ({path.name})"
    return values, sources
