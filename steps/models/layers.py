"""Building blocks the families share: RMSNorm, rotary embedding, and softmax attention over a key/value cache
(the attention kind "softmax_kv_cache", steps/models/family.py): its masks and its arithmetic. A family's layers
hold the parameters under its own names and call these."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.kernels import grouped_attention, rms_norm


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as Qwen3MoeRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, head_dim], computed in fp32 (both halves share the frequencies)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D] -> [B, heads, T, D]."""
    if q.device.type == "cpu":
        return grouped_attention(q, k, v, mask, scaling)
    # Expand the kv heads to the query heads: with a mask, SDPA's GQA mode falls back to the math kernel on
    # CUDA, while expanded k/v run in the memory-efficient kernel.
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)


def attention_mask_for(key_valid: torch.Tensor, start: int, seq: int) -> torch.Tensor:
    """Boolean SDPA mask [B, 1, seq, start+seq]: query i (slot start+i) sees the valid slots j <= start+i.

    Every query also sees its own slot, so a padding query never has an empty row (softmax of nothing gives
    NaN, and a NaN value, even at weight 0, would poison the real tokens that attend past it).
    """
    total = key_valid.shape[1]
    query_slot = torch.arange(start, start + seq, device=key_valid.device)[:, None]
    key_slot = torch.arange(total, device=key_valid.device)[None, :]
    causal = key_slot <= query_slot
    mask = (causal[None] & key_valid[:, None, :]) | (key_slot == query_slot)[None]
    return mask[:, None]
