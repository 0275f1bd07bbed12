"""What the torch engine's decoder (softmax attention over a key/value cache, steps/engines/torch_engine.py) reads
of a built MiniMax-M2 model: its modules, by their role, and grouped-query projections with q/k norms over the whole
projections and the rotation over the first rotary_dim dims of each head (RotaryTable over those dims: the same
inv_freq as transformers, theta^(-2i/rotary_dim))."""

from __future__ import annotations

from torch import nn

from steps.models.decoding import GqaProjection, RotaryTable
from steps.models.family import DecodeLayer, DecodeModel
from steps.models.minimax_m2.model import MiniMaxM2CausalLM


def decode_model(model: nn.Module) -> DecodeModel:
    assert isinstance(model, MiniMaxM2CausalLM)
    cfg = model.config
    assert cfg.head_dim is not None and cfg.rotary_dim is not None
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        project = GqaProjection(
            attn.q_proj, attn.k_proj, attn.v_proj, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling,
            query_norm=attn.q_norm, key_norm=attn.k_norm, rotary_dim=cfg.rotary_dim, norms_over_projection=True,
        )  # fmt: skip
        norms = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(DecodeLayer(norms[0], project, attn.o_proj, norms[1], layer.block_sparse_moe))
    embed = model.model.embed_tokens
    return DecodeModel(
        embed=embed,
        layers=layers,
        norm=model.model.norm,
        output=model.output_weight(),
        rotary=RotaryTable.default(cfg.rotary_dim, cfg.rope_theta, embed.weight.dtype, embed.weight.device),
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        key_dim=cfg.head_dim,
        value_dim=cfg.head_dim,
    )
