"""gpt-oss's rotary embedding: default or YaRN frequencies over the whole head and the YaRN attention factor on
cos/sin, as transformers' GptOssRotaryEmbedding with modeling_rope_utils.py's _compute_yarn_parameters (the same
float32 operations; gpt-oss's configs set truncate false: the ramp's bounds are not rounded)."""

from __future__ import annotations

import math

import torch

from steps.models.gpt_oss.config import GptOssConfig


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(cfg: GptOssConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """The rotary frequencies [head_dim / 2] and the factor cos and sin are multiplied by."""
    assert cfg.head_dim is not None
    dim, base = cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
    yarn = cfg.rope_scaling
    if yarn is None:
        return 1.0 / pos_freqs, 1.0
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
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


def rotary_cos_sin(cfg: GptOssConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, head_dim] (both halves share the frequencies: the rotate-half form of
    gpt-oss's half-split rotation), times the attention factor, computed in fp32 and cast to dtype."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg, positions.device)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)
