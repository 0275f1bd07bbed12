"""What the torch engine's decoder (softmax attention over a key/value cache, steps/engines/torch_engine.py) reads
of a built Mixtral model: its modules, by their role, and grouped-query projections without norms.

The decoder attends to every cached key: a model whose sliding window could bind (MixtralConfig.window_can_bind;
config.json loading refuses those already) is refused here rather than decoded without its window."""

from __future__ import annotations

from torch import nn

from steps.errors import MoerlError
from steps.models.decoding import GqaProjection, RotaryTable
from steps.models.family import DecodeLayer, DecodeModel
from steps.models.mixtral.model import MixtralCausalLM


def decode_model(model: nn.Module) -> DecodeModel:
    assert isinstance(model, MixtralCausalLM)
    cfg = model.config
    assert cfg.head_dim is not None
    if cfg.window_can_bind():
        raise MoerlError(
            f"the torch engine's decoder has no sliding-window attention: Mixtral's sliding_window = "
            f"{cfg.sliding_window} < max_position_embeddings = {cfg.max_position_embeddings} could bind"
        )
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        project = GqaProjection(
            attn.q_proj, attn.k_proj, attn.v_proj, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
        )
        norms = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(DecodeLayer(norms[0], project, attn.o_proj, norms[1], layer.block_sparse_moe))
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
