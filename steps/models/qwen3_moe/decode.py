"""What the torch engine's decoder (softmax attention over a key/value cache, steps/engines/torch_engine.py) reads
of a built Qwen3-MoE model: its modules, by their role, and the sizes the decode needs."""

from __future__ import annotations

from torch import nn

from steps.models.family import DecodeLayer, DecodeModel
from steps.models.qwen3_moe.model import MoeForCausalLM


def decode_model(model: nn.Module) -> DecodeModel:
    assert isinstance(model, MoeForCausalLM)
    cfg = model.config
    assert cfg.head_dim is not None
    layers = [
        DecodeLayer(
            attention_norm=layer.input_layernorm,
            qkv=(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            query_norm=layer.self_attn.q_norm,
            key_norm=layer.self_attn.k_norm,
            scaling=layer.self_attn.scaling,
            out=layer.self_attn.o_proj,
            mlp_norm=layer.post_attention_layernorm,
            mlp=layer.mlp,
        )
        for layer in model.model.layers
    ]
    embed = model.model.embed_tokens
    return DecodeModel(
        embed=embed,
        layers=layers,
        norm=model.model.norm,
        output=embed.weight if model.lm_head is None else model.lm_head.weight,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
    )
