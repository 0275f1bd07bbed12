"""gpt-oss's rotary embedding: default or YaRN frequencies over the whole head and the YaRN attention factor on
cos/sin, as transformers' GptOssRotaryEmbedding (the arithmetic is steps/models/rope.py's; gpt-oss's configs set
truncate false: the ramp's bounds are not rounded)."""

from __future__ import annotations

import torch

from steps.models.gpt_oss.config import GptOssConfig
from steps.models.rope import scaled_cos_sin, yarn_frequencies


def inv_freq_and_attention_factor(cfg: GptOssConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """The rotary frequencies [head_dim / 2] and the factor cos and sin are multiplied by."""
    assert cfg.head_dim is not None
    return yarn_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)


def rotary_cos_sin(cfg: GptOssConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, head_dim] (both halves share the frequencies: the rotate-half form of
    gpt-oss's half-split rotation), times the attention factor, computed in fp32 and cast to dtype."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg, positions.device)
    return scaled_cos_sin(positions, inv_freq, attention_factor, dtype)
