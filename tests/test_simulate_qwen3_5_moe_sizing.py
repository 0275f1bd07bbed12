"""Model-aware sizing of Qwen3.5-MoE (pipelines/simulate/model_sizing.py): parameter counts against transformers' own
Qwen3_5MoeForConditionalGeneration built on the meta device, its vision tower counted as carried (in the version's
bytes, not in the active parameters, the FLOPs or the optimizer state), the linear-attention state and KV cache of
its hybrid layers, and the 397B-A17B config (bench/model_configs/qwen3.5-397b-a17b.json) against its model card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pipelines.simulate.cli import register
from pipelines.simulate.model_sizing import GB, model_sizing, trainer_memory

REPO = Path(__file__).resolve().parents[1]
EKS = REPO / "configs" / "eks-p5en.yaml"
QWEN35_397B = REPO / "bench" / "model_configs" / "qwen3.5-397b-a17b.json"

TEXT = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 12, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40}  # fmt: skip
VISION = {"depth": 2, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": 64,
          "num_position_embeddings": 16, "patch_size": 4}  # fmt: skip


def small_config(tied: bool) -> dict:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=tied)
    d = config.to_dict()
    d["text_config"]["tie_word_embeddings"] = tied
    return d


def meta_counts(d: dict) -> tuple[int, int, int, int]:
    """(every parameter, the routed experts', the embedding's, the vision tower's) of transformers'
    Qwen3_5MoeForConditionalGeneration of config.json dict `d`, built on the meta device."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        model = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(**d))
    params = dict(model.named_parameters())  # a tied lm_head is the embedding's tensor: named once
    expert = sum(p.numel() for name, p in params.items() if ".mlp.experts." in name)
    embedding = params["model.language_model.embed_tokens.weight"].numel()
    vision = sum(p.numel() for name, p in params.items() if name.startswith("model.visual."))
    return model.num_parameters(), expert, embedding, vision


@pytest.mark.parametrize("tied", [False, True])
def test_counts_match_transformers_meta_model_with_the_vision_tower_carried(tied):
    d = small_config(tied)
    total, expert, embedding, vision = meta_counts(d)
    m = model_sizing(d)
    assert m.total == total and m.expert == expert > 0 and m.carried == vision > 0
    assert m.non_expert == total - expert
    assert m.active == m.non_expert - vision + expert * 2 // 8  # a text token never runs the tower
    assert m.embedding == embedding and m.unembedding == (0 if tied else embedding)
    assert m.compute == m.active - embedding
    assert m.optimizer_bytes == 12 * (total - vision) and m.version_bytes == 2 * total
    assert len(m.attention) == 1 and len(m.linear_attention) == 3  # every 4th layer full attention


def test_the_trainer_holds_the_tower_without_gradients_or_optimizer_state():
    m = model_sizing(small_config(False))
    table = trainer_memory(m, ep=2, dp=1, micro_batch=1, seq_len=64, kl_ref=False, gpu="H200", capacity_gb=141)
    rows = dict(table.rows)
    trained = m.non_expert - m.carried + m.expert / 2
    assert rows["weights (bf16)"] == pytest.approx(2 * trained / GB)
    assert rows["AdamW moments (fp32 exp_avg, exp_avg_sq)"] == pytest.approx(8 * trained / GB)
    assert rows["carried unchanged (the vision tower, fp32 buffers)"] == pytest.approx(4 * m.carried / GB)


def test_the_397b_config_sizes_as_the_model_card():
    """hf.co/Qwen/Qwen3.5-397B-A17B: 397B parameters, 17B activated. The config is assembled from sourced figures
    (bench/README.md says which); the counts land on the card's: 396.8B in all (0.46B of it the vision tower),
    17.3B active a token with the embeddings, 15.3B without."""
    m = model_sizing(json.loads(QWEN35_397B.read_text()), source=str(QWEN35_397B))
    assert m.total == pytest.approx(397e9, rel=0.005)
    assert m.active == pytest.approx(17e9, rel=0.03)
    assert m.carried == pytest.approx(0.456e9, rel=0.01)
    assert m.num_experts == 512 and m.experts_per_token == 10
    assert len(m.attention) == 15 and len(m.linear_attention) == 45
    assert m.kv_bytes_per_token(1) == 2 * 2 * 256 * 2 * 15  # 30 KB a token: the 15 full-attention layers
    assert m.state_bytes_per_sequence == 45 * ((2 * 16 * 128 + 64 * 128) * 3 * 2 + 64 * 128 * 128 * 4)


def test_simulate_prints_the_397b_model_with_its_vision_tower(capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", str(EKS), "--iterations", "2", "--model-config", str(QWEN35_397B)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "396.8B parameters" in out and "0.5B carried unchanged (the vision tower)" in out
    assert "17.3B active a token (top-10)" in out and "linear-attention state for the chunk" in out
