"""What the torch engine's decoder (softmax attention over a key/value cache, steps/engines/torch_engine.py) reads
of a built Qwen2-MoE model: its modules, by their role, and grouped-query projections with q/k/v biases and no
norms (the sparse blocks' shared expert and its gate are read through SparseMoeBlock.shared_output)."""

from __future__ import annotations

from torch import nn

from steps.models.decoding import GqaProjection, RotaryTable
from steps.models.family import DecodeLayer, DecodeModel
from steps.models.qwen2_moe.model import Qwen2MoeForCausalLM


def decode_model(model: nn.Module) -> DecodeModel:
    assert isinstance(model, Qwen2MoeForCausalLM)
    cfg = model.config
    assert cfg.head_dim is not None
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        project = GqaProjection(
            attn.q_proj, attn.k_proj, attn.v_proj, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
        )
        norms = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(DecodeLayer(norms[0], project, attn.o_proj, norms[1], layer.mlp))
    embed = model.model.embed_tokens
    return DecodeModel(
        embed=embed,
        layers=layers,
        norm=model.model.norm,
        output=model.output_weight(),
        rotary=RotaryTable.default(cfg.head_dim, cfg.rope_theta, embed.weight.dtype, embed.weight.device),
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        key_dim=cfg.head_dim,
        value_dim=cfg.head_dim,
    )
