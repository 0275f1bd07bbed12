"""The peers' published end-to-end figures for the models the reference configs train, so that `moerl simulate`
sets its tokens/s per GPU beside them. A figure is generated tokens a second per GPU over every GPU of the run
(NeMo-RL's "Tokens/s/GPU": a step's samples x their mean generated length / the step time / the GPUs), with the
setting it was measured in; the source is the file and the version it was read at.

Only NeMo-RL publishes step times with GPU counts, batch and lengths for these models (v0.6,
docs/about/performance-summary.md, NVIDIA-NeMo/RL@7ea279a, lines 56-92; recipes under
examples/configs/recipes/llm/performance/). verl publishes one DeepSeek-V3 run on H20s (docs/perf/dpsk.md); slime
and Miles publish configurations, no step times; nobody publishes Kimi-K2 figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.simulate.model_sizing import ModelSizing


@dataclass(frozen=True)
class Published:
    peer: str
    gpus: str
    setting: str
    tokens_per_gpu_s: float
    step_s: float
    source: str
    asynchronous: bool = False  # off-policy (set beside the config's async figure), else on-policy (its sync)


NEMO_RL = "NeMo-RL v0.6 docs/about/performance-summary.md"
# (model_type, total parameters in billions, rounded) -> figures
PUBLISHED: dict[tuple[str, int], list[Published]] = {
    ("qwen3_moe", 31): [
        Published("NeMo-RL", "32 H100", "on-policy, colocated, 2,048 samples, mean 3,203 tokens", 1102, 192,
                  NEMO_RL),
        Published("NeMo-RL", "32 H100", "1-step off-policy", 1414, 152, NEMO_RL, asynchronous=True),
        Published("verl", "128 H20", "512 x 16 samples up to 8K, colocated sync", 0, 497.89,
                  "verl docs/advance/fully_async.md"),
    ],
    ("qwen3_moe", 235): [
        Published("NeMo-RL", "128 H100", "on-policy, colocated, 512 samples, mean 5,698 tokens", 58.9, 395,
                  NEMO_RL),
        Published("NeMo-RL", "256 H100", "1-step off-policy, 16 + 16 nodes", 58.7, 231, NEMO_RL, asynchronous=True),
    ],
    ("deepseek_v3", 671): [
        Published("NeMo-RL", "256 H100", "on-policy, 512 samples, mean 701 tokens", 12.1, 134, NEMO_RL),
        Published("NeMo-RL", "512 H100", "1-step off-policy, fp8 generation and training", 14.1, 59.2, NEMO_RL,
                  asynchronous=True),
        Published("verl", "96 H20", "colocated, full offload, mean response 1,960", 0, 1700, "verl docs/perf/dpsk.md"),
    ],
}


def published_for(m: ModelSizing) -> list[Published]:
    return PUBLISHED.get((m.model_type, round(m.total / 1e9)), [])


def lines(m: ModelSizing, tokens_per_iteration: float, gpus: int, sync_s: float, async_s: float) -> list[str]:
    """The config's generated tokens/s per GPU (every GPU of the run), sync and async, and the peers' figures."""
    sync_rate, async_rate = tokens_per_iteration / sync_s / gpus, tokens_per_iteration / async_s / gpus
    out = [f"generated tokens/s per GPU over the run's {gpus:,} GPUs: {sync_rate:,.1f} sync, {async_rate:,.1f} async"]
    for p in published_for(m):
        rate = f"{p.tokens_per_gpu_s:,.1f} tokens/s per GPU, " if p.tokens_per_gpu_s else ""
        ours, mode = (async_rate, "async") if p.asynchronous else (sync_rate, "sync")
        ratio = f" (this config: {ours / p.tokens_per_gpu_s:.2f}x, {mode})" if p.tokens_per_gpu_s else ""
        out.append(f"  published: {p.peer}, {p.gpus}, {p.setting}: {rate}{p.step_s:,.0f} s a step{ratio} "
                   f"[{p.source}]")  # fmt: skip
    return out
