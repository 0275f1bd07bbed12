"""DeepSeek-V3's rotary embedding over the qk_rope_head_dim dims of each head: default or YaRN frequencies, the
YaRN attention factor on cos/sin, the softmax scale with YaRN's mscale, and the interleaved layout.

The arithmetic is transformers' (modeling_rope_utils.py _compute_yarn_parameters, modeling_deepseek_v3.py
yarn_apply_mscale and apply_rotary_pos_emb_interleave), in the same float32 operations.
"""

from __future__ import annotations

import math

import torch

from steps.models.deepseek_v3.config import DeepseekConfig


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(
    cfg: DeepseekConfig, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, float]:
    """The rotary frequencies [qk_rope_head_dim / 2] and the factor cos and sin are multiplied by."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    yarn = cfg.rope_scaling
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor = yarn["factor"]
    original = yarn["original_max_position_embeddings"]
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def softmax_scale(cfg: DeepseekConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when mscale_all_dim is set."""
    scale = cfg.qk_head_dim ** (-0.5)
    yarn = cfg.rope_scaling
    if yarn is not None and yarn.get("mscale_all_dim"):
        m = _mscale(yarn["factor"], yarn["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rotary_cos_sin(
    cfg: DeepseekConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, qk_rope_head_dim] (both halves share the frequencies), times the
    attention factor, computed in fp32 and cast to dtype (DeepseekV3RotaryEmbedding)."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg, positions.device)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dims in DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the
    half-split layout rotate_half rotates. Rotating that equals apply_rotary_pos_emb_interleave, whose output is
    in the half-split layout too."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
