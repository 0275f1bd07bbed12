"""What the torch engine's decoder (softmax attention over a key/value cache, steps/engines/torch_engine.py) reads
of a built gpt-oss model: its modules, by their role; grouped-query projections with q/k/v biases and no norms,
YaRN rotary tables; and per layer the attention sinks and the sliding window (DecodeLayer.sinks / window)."""

from __future__ import annotations

from torch import nn

from steps.models.decoding import GqaProjection, RotaryTable
from steps.models.family import DecodeLayer, DecodeModel
from steps.models.gpt_oss.model import GptOssCausalLM
from steps.models.gpt_oss.rope import inv_freq_and_attention_factor


def decode_model(model: nn.Module) -> DecodeModel:
    assert isinstance(model, GptOssCausalLM)
    cfg = model.config
    assert cfg.head_dim is not None
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        project = GqaProjection(
            attn.q_proj, attn.k_proj, attn.v_proj, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
        )
        norms = layer.input_layernorm, layer.post_attention_layernorm
        extras = {"sinks": attn.sinks, "window": attn.sliding_window}
        layers.append(DecodeLayer(norms[0], project, attn.o_proj, norms[1], layer.mlp, **extras))
    embed = model.model.embed_tokens
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg, embed.weight.device)
    return DecodeModel(
        embed=embed,
        layers=layers,
        norm=model.model.norm,
        output=model.output_weight(),
        rotary=RotaryTable(inv_freq, embed.weight.dtype, attention_factor),
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        key_dim=cfg.head_dim,
        value_dim=cfg.head_dim,
    )
