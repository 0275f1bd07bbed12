"""The reference configs at scale and the physical floor `moerl simulate` prints for them: each config fits its
GPUs by the memory tables for its own model (bench/model_configs/, the published config.json of each), the floor's
terms are the arithmetic its docstring states, and the model configs are the ones the sizing tests check against
the model cards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_simulate_model_sizing import DEEPSEEK_V3, KIMI_K2, QWEN3_235B

from pipelines.config import load_config
from pipelines.simulate.floor import GPU_SPECS, physical_floor
from pipelines.simulate.memory_check import rollout_memory_problem, trainer_memory_problem
from pipelines.simulate.model_sizing import model_sizing, reference_sizing
from pipelines.simulate.sizing import GPU_ASSUMPTIONS, flops_seq_len, model_assumptions

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "bench" / "model_configs"


def test_the_bench_model_configs_are_the_checked_ones():
    for name, d in (("qwen3-235b-a22b", QWEN3_235B), ("deepseek-v3", DEEPSEEK_V3), ("kimi-k2", KIMI_K2)):
        assert json.loads((MODELS / f"{name}.json").read_text()) == d, name


REFERENCE = [
    ("eks-p5en.yaml", None),
    ("eks-p5en-235b.yaml", "qwen3-235b-a22b.json"),
]


def _sized(model: str | None):
    return reference_sizing() if model is None else model_sizing(json.loads((MODELS / model).read_text()), model)


@pytest.mark.parametrize(("config", "model"), REFERENCE)
def test_each_reference_config_fits_its_gpus(config, model):
    cfg = load_config(REPO / "configs" / config, {})
    m = _sized(model)
    assert trainer_memory_problem(cfg, m) is None
    assert rollout_memory_problem(cfg, m) is None


def test_the_floor_is_the_stated_arithmetic():
    cfg = load_config(REPO / "configs" / "eks-p5en.yaml", {})
    m = reference_sizing()
    a = model_assumptions(GPU_ASSUMPTIONS, m, reference_sizing(), flops_seq_len(cfg, GPU_ASSUMPTIONS))
    floor = physical_floor(cfg, m, a)
    assert floor is not None
    tflops, hbm = GPU_SPECS["H200"]
    samples, seq = 1024 * 16, 256 + 4096
    assert floor.training_s == pytest.approx(samples * seq * m.flops_per_token(seq) / (128 * tflops * 1e12))
    # 32 engines of 8 GPUs, 512 sequences each, all at once; 4096 decode steps, each HBM-bound: the engine's
    # weights a GPU and the batch's KV cache at the mean context, read at 4.8 TB/s
    weights_gb = 2 * (m.non_expert / 8 + m.expert / 8) / 1e9
    kv_gb = 1 * m.kv_elements_per_head * 2 / 1e9
    step = (weights_gb + 512 * (256 + 2048) * kv_gb) / (hbm * 1e3)
    assert step > 512 * m.flops_per_token(256 + 2048) / 3 / (8 * tflops * 1e12)  # memory, not compute
    assert floor.rollout_s == pytest.approx(4096 * step)
    assert floor.sync_s == pytest.approx(floor.rollout_s + floor.training_s + floor.weights_s)
    assert floor.async_s == max(floor.rollout_s, floor.training_s + floor.weights_s)
    line = floor.lines(10 * floor.sync_s, 10 * floor.async_s)[-1]
    assert "10.0x the floor sync" in line and "10.0x async" in line


def test_no_floor_without_a_known_gpu():
    cfg = load_config(REPO / "configs" / "demo.yaml", {"sft_checkpoint": "file:///x", "run_store": "file:///y"})
    assert physical_floor(cfg, reference_sizing(), GPU_ASSUMPTIONS) is None


def test_the_peers_figures_sit_beside_the_configs_own():
    from pipelines.simulate import published

    m = _sized("qwen3-235b-a22b.json")
    assert [p.peer for p in published.published_for(m)] == ["NeMo-RL", "NeMo-RL"]
    assert published.published_for(reference_sizing())[0].tokens_per_gpu_s == 1102
    out = published.lines(m, tokens_per_iteration=1_000_000, gpus=100, sync_s=1000.0, async_s=500.0)
    assert out[0].endswith("10.0 sync, 20.0 async")
    on_policy, off_policy = out[1], out[2]
    assert f"(this config: {10 / 58.9:.2f}x, sync)" in on_policy and "performance-summary.md" in on_policy
    assert f"(this config: {20 / 58.7:.2f}x, async)" in off_policy
    assert published.published_for(model_sizing(KIMI_K2)) == []  # nobody publishes Kimi-K2's
