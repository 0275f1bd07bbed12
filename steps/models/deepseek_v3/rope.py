"""DeepSeek-V3's rotary embedding over the qk_rope_head_dim dims of each head: default or YaRN frequencies, the
YaRN attention factor on cos/sin, the softmax scale with YaRN's mscale, and the interleaved layout.

The arithmetic is transformers' (modeling_rope_utils.py _compute_yarn_parameters, shared in steps/models/rope.py;
modeling_deepseek_v3.py yarn_apply_mscale and apply_rotary_pos_emb_interleave), in the same float32 operations.
"""

from __future__ import annotations

import torch

from steps.models.deepseek_v3.config import DeepseekConfig
from steps.models.rope import scaled_cos_sin, yarn_frequencies, yarn_mscale


def inv_freq_and_attention_factor(
    cfg: DeepseekConfig, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, float]:
    """The rotary frequencies [qk_rope_head_dim / 2] and the factor cos and sin are multiplied by."""
    return yarn_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, device)


def softmax_scale(cfg: DeepseekConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when mscale_all_dim is set."""
    scale = cfg.qk_head_dim ** (-0.5)
    yarn = cfg.rope_scaling
    if yarn is not None and yarn.get("mscale_all_dim"):
        m = yarn_mscale(yarn["factor"], yarn["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rotary_cos_sin(
    cfg: DeepseekConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, qk_rope_head_dim] (both halves share the frequencies), times the
    attention factor, computed in fp32 and cast to dtype (DeepseekV3RotaryEmbedding)."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg, positions.device)
    return scaled_cos_sin(positions, inv_freq, attention_factor, dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dims in DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the
    half-split layout rotate_half rotates. Rotating that equals apply_rotary_pos_emb_interleave, whose output is
    in the half-split layout too."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
