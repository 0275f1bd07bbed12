"""Model-aware sizing of DeepSeek-V3.2 (pipelines/simulate/model_sizing.py): parameter counts against transformers'
own DeepseekV32ForCausalLM built on the meta device (the indexers counted), the attention term capped at index_topk
keys a query, the indexer's scoring in the FLOPs, the index keys beside the MLA latent in the engine's cache, and
the released config (bench/model_configs/deepseek-v3.2.json, verbatim) against DeepSeek-V3's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.simulate.model_sizing import model_sizing

REPO = Path(__file__).resolve().parents[1]
V32 = REPO / "bench" / "model_configs" / "deepseek-v3.2.json"
V3 = REPO / "bench" / "model_configs" / "deepseek-v3.json"

SMALL = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": 96,
         "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "index_n_heads": 16, "index_head_dim": 8,
         "index_topk": 5, "first_k_dense_replace": 1, "torch_dtype": "bfloat16"}  # fmt: skip


def test_counts_match_transformers_meta_model():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.DeepseekV32Config(**{k: v for k, v in SMALL.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.DeepseekV32ForCausalLM(hf)
    params = dict(model.named_parameters())
    indexer = sum(p.numel() for name, p in params.items() if ".indexer." in name)
    m = model_sizing(SMALL)
    buffers = 2 * 8  # the MoE layers' correction bias: a tensor of the checkpoint, a buffer to transformers
    assert m.total == model.num_parameters() + buffers and indexer > 0
    assert m.frozen == indexer and m.optimizer_bytes == 12 * (m.total - indexer)  # frozen: no AdamW state
    assert m.expert == sum(p.numel() for name, p in params.items() if ".mlp.experts." in name)


def test_attention_is_capped_at_index_topk_and_the_indexer_scores_every_key():
    m = model_sizing(SMALL)
    assert all(window == 5 for *_, window in m.attention) and m.index_scoring == ((16, 8),) * 3
    attention = 3 * 4 * (12 + 8)  # layers x heads x (d_qk + d_v) a key
    for t in (4.0, 64.0):
        index = 3 * 16 * 8 * t  # every earlier key scored by every index head, forward only
        assert m.flops_per_token(t) == pytest.approx(6 * m.compute + 6 * attention * min(t, 5) + 2 * index)
    # the MLA latent (bf16) and the index key (FP8 + a float32 scale a 128 dims) of every layer
    assert m.kv_bytes_per_token(1) == 3 * (16 + 4) * 2 + 3 * (8 + 0)


def test_the_released_config_sizes_as_deepseek_v3_plus_its_indexers():
    """DeepSeek-V3.2's card: 685B parameters with the multi-token-prediction module, which moerl drops; without it
    DeepSeek-V3's 671B plus 61 indexers (0.85B)."""
    v32 = model_sizing(json.loads(V32.read_text()), source=str(V32))
    v3 = model_sizing(json.loads(V3.read_text()), source=str(V3))
    indexer = 61 * (64 * 128 * 1536 + 128 * 7168 + 2 * 128 + 64 * 7168)
    assert v32.total == v3.total + indexer and v32.active == v3.active + indexer
    assert v32.kv_bytes_per_token(8) == v3.kv_bytes_per_token(8) + 61 * 132
    assert v32.flops_per_token(4352) < v3.flops_per_token(4352)  # 2,048 keys a query instead of 4,352
