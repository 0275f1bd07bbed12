"""Model-aware sizing of Qwen3-Next (pipelines/simulate/model_sizing.py): parameter counts against transformers' own
Qwen3NextForCausalLM built on the meta device, the FLOPs of its gated DeltaNet layers (no term in the context
length), the rollout engine's KV cache of the full-attention layers only, the linear-attention state each sequence
adds, and the published 80B-A3B config (bench/model_configs/qwen3-next-80b-a3b.json) against its model card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pipelines.simulate.cli import register
from pipelines.simulate.model_sizing import GB, model_sizing, reference_sizing, rollout_memory

REPO = Path(__file__).resolve().parents[1]
EKS = REPO / "configs" / "eks-p5en.yaml"
NEXT_80B = REPO / "bench" / "model_configs" / "qwen3-next-80b-a3b.json"

# Every layer kind: layers 0, 2 DeltaNet + MoE, 1 DeltaNet + dense MLP, 3 full attention + dense MLP, 7 full
# attention + MoE (full_attention_interval 4); key and value head dims differ, as do the three MLP widths.
SMALL: dict = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 96,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 3, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
    "mlp_only_layers": [1, 3], "full_attention_interval": 4, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}  # fmt: skip
FULL_LAYERS, LINEAR_LAYERS = 2, 6


def meta_model_counts(config: dict) -> tuple[int, int, int]:
    """(every parameter, the routed experts', the embedding's) of transformers' Qwen3NextForCausalLM of `config`,
    built on the meta device."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.Qwen3NextConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    params = dict(model.named_parameters())  # a tied lm_head is the embedding's tensor: named once
    expert = sum(p.numel() for name, p in params.items() if ".mlp.experts." in name)
    embedding = params["model.embed_tokens.weight"].numel()
    return model.num_parameters(), expert, embedding


@pytest.mark.parametrize("tied", [False, True])
def test_counts_match_transformers_meta_model(tied):
    config = {**SMALL, "tie_word_embeddings": tied}
    total, expert, embedding = meta_model_counts(config)
    m = model_sizing(config)
    assert m.total == total
    assert m.expert == expert > 0
    assert m.non_expert == total - expert
    assert m.active == m.non_expert + expert * 2 // 8
    assert m.embedding == embedding and m.unembedding == (0 if tied else embedding)
    assert m.compute == m.active - embedding
    assert m.num_experts == 8 and m.experts_per_token == 2 and m.version_bytes == 2 * total


def test_flops_count_deltanet_state_updates_and_attention_of_full_layers_only():
    m = model_sizing(SMALL)
    assert len(m.attention) == FULL_LAYERS and m.linear_attention == ((4, 8, 12),) * LINEAR_LAYERS
    attention = FULL_LAYERS * 4 * (16 + 16)  # heads x (d_qk + d_v), a token of context, full layers only
    delta_rule = LINEAR_LAYERS * 4 * 4 * 8 * 12  # 4 x d_k x d_v multiply-adds a value head, every DeltaNet layer
    for t in (1.0, 4096.0):
        assert m.flops_per_token(t) == pytest.approx(6 * m.compute + 6 * attention * t + 6 * delta_rule)
    assert len(m.layer_activation_elements) == 8


def test_kv_cache_only_for_full_attention_layers():
    m = model_sizing(SMALL)
    # keys and values (2) x kv heads x head_dim x bf16 (2 bytes) x the full-attention layers
    assert m.kv_bytes_per_token(1) == 2 * 2 * 16 * 2 * FULL_LAYERS
    assert m.kv_bytes_per_token(2) == 2 * 1 * 16 * 2 * FULL_LAYERS  # the two KV heads over TP 2


def test_the_linear_attention_state_of_a_sequence():
    m = model_sizing(SMALL)
    conv = (2 * 2 * 8 + 4 * 12) * (3 - 1) * 2  # channels x the K - 1 inputs SGLang keeps x bf16
    recurrent = 4 * 8 * 12 * 4  # Hv x d_k x d_v, fp32
    assert m.state_bytes_per_sequence == LINEAR_LAYERS * (conv + recurrent)
    assert m.sequence_state_bytes(2) == m.state_bytes_per_sequence / 2
    assert reference_sizing().state_bytes_per_sequence == 0  # softmax-attention families have none

    table, held = rollout_memory(m, tp=1, ep=1, sequences=100, seq_len=1000, mem_fraction=0.85, gpu="H200",
                                 capacity_gb=141)  # fmt: skip
    rows = dict(table.rows)
    kv = next(gb for what, gb in rows.items() if what.startswith("KV cache"))
    state = next(gb for what, gb in rows.items() if what.startswith("linear-attention state"))
    assert kv == pytest.approx(100 * 1000 * m.kv_bytes_per_token(1) / GB)
    assert state == pytest.approx(100 * m.state_bytes_per_sequence / GB)
    assert "linear-attention state a sequence" in table.formula and held == 1.0
    plain, _ = rollout_memory(reference_sizing(), tp=1, ep=1, sequences=100, seq_len=1000, mem_fraction=0.85,
                              gpu="H200", capacity_gb=141)  # fmt: skip
    assert not any("linear-attention" in what for what, _ in plain.rows)


def test_the_80b_config_sizes_as_the_model_card():
    """hf.co/Qwen/Qwen3-Next-80B-A3B-Instruct: 80B parameters, 79B without the embeddings, "3B activated". The 3B
    is a rounded figure: every count of the active parameters is above it (with the embedding table and lm_head
    3.87B, without them 3.25B, 3.1B without the shared experts too), so active is held to the card's 3B only
    loosely."""
    m = model_sizing(json.loads(NEXT_80B.read_text()), source=str(NEXT_80B))
    assert m.total == pytest.approx(80e9, rel=0.01)
    assert m.total - m.embedding - m.unembedding == pytest.approx(79e9, rel=0.01)
    assert m.active_non_embedding == pytest.approx(3e9, rel=0.1)
    assert m.expert + m.non_expert == m.total and m.num_experts == 512 and m.experts_per_token == 10
    assert len(m.attention) == 12 and len(m.linear_attention) == 36
    assert m.kv_bytes_per_token(1) == 2 * 2 * 256 * 2 * 12  # 24 KB a token
    assert m.state_bytes_per_sequence == 36 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)


def test_simulate_prints_the_80b_model_and_its_linear_attention_state(capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", str(EKS), "--iterations", "2", "--model-config", str(NEXT_80B)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "79.7B parameters" in out and "512 routed experts" in out and "3.9B active a token (top-10)" in out
    assert "linear-attention state for the chunk" in out
