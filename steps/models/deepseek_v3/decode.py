"""What the torch engine's decoder (softmax attention over a key/value cache, steps/engines/torch_engine.py) reads
of a built DeepSeek-V3 model: its modules, by their role, and multi-head latent attention's projection with the
keys and values materialised per head (kv heads = heads; keys of qk_nope + qk_rope dims, values of v_head_dim).

The cache holds the per-head keys and values, not the latent (kv_lora_rank + qk_rope_head_dim per token, what
SGLang's MLA kernels cache): simple and exact, at heads * (qk_head_dim + v_head_dim) / (kv_lora_rank +
qk_rope_head_dim) times the memory per token (about 70x for DeepSeek-V3's sizes), fine for the tiny models the
torch engine serves.
"""

from __future__ import annotations

import torch
from torch import nn

from steps.models.decoding import RotaryTable, rotate
from steps.models.deepseek_v3 import rope
from steps.models.deepseek_v3.model import Attention, DeepseekV3ForCausalLM
from steps.models.family import DecodeLayer, DecodeModel


class MlaProjection:
    """Multi-head latent attention's q, k and v for the decoder (a DecodeProjection): x [T, H] (normed) and a
    RotaryTable's (cos, sin_folded) [T, 1, qk_rope_head_dim] -> q [T, heads, qk_head_dim] times the softmax
    scale, k [T, heads, qk_head_dim] (k_nope per head, the shared rotated k_rope repeated), v [T, heads,
    v_head_dim], as Attention.project computes them. The rope dims are de-interleaved before the rotation when
    rope_interleave (rope.deinterleave), as in the forward. It reads the attention's modules directly, so an
    in-place weight update needs no refresh."""

    def __init__(self, attn: Attention) -> None:
        self.attn = attn

    def refresh(self) -> None:
        """Nothing to recompute: no fused copies."""

    def __call__(
        self, x: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin = rope_tables
        a, tokens = self.attn, x.shape[0]
        q = a.queries(x).view(tokens, a.num_heads, a.qk_dim)
        q_nope, q_rope = q.split([a.nope_dim, a.rope_dim], dim=-1)
        latent, k_rope = a.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.rope_dim], dim=-1)
        kv = a.kv_b_proj(a.kv_a_layernorm(latent)).view(tokens, a.num_heads, a.nope_dim + a.v_dim)
        k_nope, v = kv.split([a.nope_dim, a.v_dim], dim=-1)
        k_rope = k_rope.unsqueeze(1)  # [T, 1, rope_dim]: one for all heads
        if a.interleave:
            q_rope, k_rope = rope.deinterleave(q_rope), rope.deinterleave(k_rope)
        q = torch.cat([q_nope, rotate(q_rope, cos, sin)], dim=-1).mul_(a.scaling)
        k = torch.cat([k_nope, rotate(k_rope, cos, sin).expand(-1, a.num_heads, -1)], dim=-1)
        return q, k, v.contiguous()


def decode_model(model: nn.Module) -> DecodeModel:
    assert isinstance(model, DeepseekV3ForCausalLM)
    cfg = model.config
    layers = []
    for layer in model.model.layers:
        attn = layer.self_attn
        norms = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(DecodeLayer(norms[0], MlaProjection(attn), attn.o_proj, norms[1], layer.mlp))
    embed = model.model.embed_tokens
    inv_freq, attention_factor = rope.inv_freq_and_attention_factor(cfg, embed.weight.device)
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
