"""Rotary frequencies the families share: default RoPE's and YaRN's (transformers' modeling_rope_utils.py
_compute_default_rope_parameters and _compute_yarn_parameters, in the same float32 operations), and the cos/sin of
positions times an attention factor. What a family does beyond these (DeepSeek-V3's softmax scale with YaRN's
mscale, its interleaved layout) stays in the family's rope.py."""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched `scale` times (transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _position_frequencies(dim: int, base: float, device: torch.device | str) -> torch.Tensor:
    """base ** (2i / dim) for i < dim / 2: the wavelengths' divisors of default RoPE, in float32."""
    return base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)


def default_frequencies(dim: int, base: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Default RoPE's inv_freq [dim / 2]: base ** (-2i / dim)."""
    return 1.0 / _position_frequencies(dim, base, device)


def yarn_frequencies(
    dim: int, base: float, yarn: dict[str, Any] | None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2], the factor cos and sin are multiplied by) of YaRN over `dim` rotary dims, its parameters
    `yarn` (factor, original_max_position_embeddings, optional beta_fast, beta_slow, mscale, mscale_all_dim,
    attention_factor, truncate); None: default RoPE, factor 1."""
    pos_freqs = _position_frequencies(dim, base, device)
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
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


def scaled_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, 2 * len(inv_freq)] (both halves share the frequencies: the rotate-half
    layout), times `attention_factor`, computed in fp32 and cast to dtype."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)
