"""Model-aware sizing of DeepSeek-V4 (pipelines/simulate/model_sizing.py): parameter counts against transformers' own
DeepseekV4ForCausalLM built on the meta device (the hash tables and correction biases, buffers to transformers, are
checkpoint tensors), the attention term as each layer's sliding window plus its compressed entries (CSA's at most
index_topk), the CSA indexers' scoring, and the engine's cache: a compressed entry every `rate` tokens and a fixed
sliding window a sequence instead of a key and value a token. No DeepSeek-V4 config.json was reachable to cite;
transformers' DeepseekV4Config defaults (its docstring's DeepSeek-V4-Flash-Base) stand in for the released size."""

from __future__ import annotations

import pytest

from pipelines.simulate.model_sizing import model_sizing

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SMALL = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 64, "hidden_size": 32,
         "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32,
         "q_lora_rank": 16, "num_experts_per_tok": 2, "n_routed_experts": 4, "partial_rotary_factor": 0.25,
         "layer_types": [SLIDING, CSA, HCA, CSA], "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
         "compress_rates": {CSA: 4, HCA: 8}, "sliding_window": 6, "index_topk": 2, "index_n_heads": 4,
         "index_head_dim": 16, "hc_mult": 4, "o_groups": 2, "o_lora_rank": 8, "torch_dtype": "bfloat16"}  # fmt: skip


def transformers_meta_model(config: dict):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    hf = transformers.DeepseekV4Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        return hf, transformers.DeepseekV4ForCausalLM(hf)


def test_counts_match_transformers_meta_model():
    _, model = transformers_meta_model(SMALL)
    params = dict(model.named_parameters())
    buffers = sum(
        b.numel() for name, b in model.named_buffers() if name.endswith(("tid2eid", "e_score_correction_bias"))
    )
    m = model_sizing(SMALL)
    assert m.total == model.num_parameters() + buffers
    assert m.expert == sum(p.numel() for name, p in params.items() if ".mlp.experts." in name)
    assert m.embedding == 64 * 32 and m.unembedding == 64 * 32
    indexers = sum(p.numel() for name, p in params.items() if ".indexer." in name)
    assert m.frozen == indexers > 0 and m.optimizer_bytes == 12 * (m.total - indexers)


def test_attention_is_the_window_plus_the_compressed_entries():
    m = model_sizing(SMALL)
    assert m.attention == ((4, 32, 32, 6),) * 4
    assert m.compressed_attention == ((4, 64, 4, 2), (4, 64, 8, None), (4, 64, 4, 2))
    assert m.compressed_index_scoring == ((4, 16, 4), (4, 16, 4))
    for t in (5.0, 64.0):
        window = 4 * 4 * 64 * min(t, 6)
        entries = 4 * 64 * (2 * min(t / 4, 2) + t / 8)
        index = 2 * 4 * 16 * t / 4  # forward only: the indexer is frozen
        assert m.flops_per_token(t) == pytest.approx(6 * m.compute + 6 * (window + entries) + 2 * index)
    # a token: an entry of head_dim every 4 / 8 / 4 tokens (bf16), CSA's index key (FP8 + scale) every 4; the
    # windows a sequence: 6 keys of head_dim, every layer
    assert m.kv_bytes_per_token(1) == 2 * (32 / 4 + 32 / 8 + 32 / 4) + 2 * 16 / 4
    assert m.sequence_state_bytes(1) == 6 * 32 * 4 * 2


def test_the_flash_base_size_caches_far_less_than_deepseek_v3():
    """transformers' DeepseekV4Config defaults: 43 layers (2 HCA, then CSA and HCA alternating), 256 experts top-6:
    its cache a token is a compressed entry per layer, not DeepSeek-V3's 61 MLA latents (70 KB a token)."""
    hf, model = transformers_meta_model({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"})
    config = {k: v for k, v in hf.to_dict().items() if v is not None}
    m = model_sizing({**config, "architectures": ["DeepseekV4ForCausalLM"]})
    buffers = sum(
        b.numel() for name, b in model.named_buffers() if name.endswith(("tid2eid", "e_score_correction_bias"))
    )
    assert m.total == model.num_parameters() + buffers
    assert m.kv_bytes_per_token(1) < 8_000 < 61 * 576 * 2
    assert m.flops_per_token(65536) < 2 * m.flops_per_token(4096)  # compressed: nearly linear in the context
