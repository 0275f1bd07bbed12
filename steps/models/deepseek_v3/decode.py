"""What the torch engine's decoder (softmax attention over a key/value cache, steps/engines/torch_engine.py) reads
of a built DeepSeek-V3 model: its modules, by their role, and multi-head latent attention's projection with the
keys and values materialised per head (the shared steps/models/mla.py MlaProjection)."""

from __future__ import annotations

from torch import nn

from steps.models.decoding import RotaryTable
from steps.models.deepseek_v3.model import DeepseekV3ForCausalLM
from steps.models.family import DecodeLayer, DecodeModel
from steps.models.mla import MlaProjection, inv_freq_and_attention_factor


def decode_model(model: nn.Module) -> DecodeModel:
    assert isinstance(model, DeepseekV3ForCausalLM)
    cfg = model.config
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        norms = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(DecodeLayer(norms[0], MlaProjection(attn), attn.o_proj, norms[1], layer.mlp))
    embed = model.model.embed_tokens
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg, embed.weight.device)
    return DecodeModel(
        embed=embed,
        layers=layers,
        norm=model.model.norm,
        output=model.output_weight(),
        rotary=RotaryTable(inv_freq, embed.weight.dtype, attention_factor),
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_attention_heads,
        key_dim=cfg.qk_head_dim,
        value_dim=cfg.v_head_dim,
    )
