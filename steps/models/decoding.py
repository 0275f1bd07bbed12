"""Parts a family's decode (steps/models/<family>/decode.py) builds the torch engine's view of a model from: a
rotary table, and the projection of grouped-query attention (q, k and v as one matrix, optional per-head q/k
norms, full or partial rotary embedding). Multi-head latent attention and other projections are their family's.

Rotation follows transformers' rotate_half: x * cos + rotate_half(x) * sin over the rotary dims, computed here as
x * cos + roll(x, D/2) * sin_folded with sin_folded = (-sin[:D/2], sin[D/2:]) (one roll, no concatenation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.rope import default_frequencies


class RotaryTable:
    """cos and sign-folded sin [T, 1, D] at token positions [T], from a table grown by doubling.

    inv_freq [D/2]: the rotary frequencies (default RoPE: theta ** (-2i / D)); attention_scaling multiplies cos
    and sin (YaRN's mscale). The table is computed in fp32 and cast to `dtype`, as rotary_cos_sin does."""

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype, attention_scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.float()
        self.dtype = dtype
        self.attention_scaling = attention_scaling
        self.dim = 2 * inv_freq.numel()
        self.cos = self.sin = torch.empty(0, self.dim, dtype=dtype)

    @classmethod
    def default(cls, dim: int, theta: float, dtype: torch.dtype, device: torch.device | str = "cpu") -> RotaryTable:
        """Default RoPE over `dim` dims (layers.rotary_cos_sin's frequencies)."""
        return cls(default_frequencies(dim, theta, device), dtype)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.cos.shape[0]:
            length = max(needed, 2 * self.cos.shape[0], 64)
            table = torch.arange(length, device=self.inv_freq.device)
            freqs = table[:, None].float() * self.inv_freq.to(table.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
            half = self.dim // 2
            self.cos = cos.to(self.dtype)
            self.sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(self.dtype)
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_folded: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by a RotaryTable's cos and sin_folded (broadcast over the heads)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_folded)


class GqaProjection:
    """Grouped-query attention's q, k and v for the decoder (a DecodeProjection): one matmul against
    [W_q; W_k; W_v] (and bias), optional RMSNorm of q and k before the rotation (per head, or with
    norms_over_projection over the whole q and k projections before they are cut into heads: MiniMax-M2), the
    rotation over the first `rotary_dim` dims of each head (all of them by default; GLM's and MiniMax-M2's partial
    rotary keeps the rest), q times `scaling`."""

    def __init__(
        self,
        query: nn.Linear,
        key: nn.Linear,
        value: nn.Linear,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        query_norm: nn.Module | None = None,
        key_norm: nn.Module | None = None,
        rotary_dim: int | None = None,
        norms_over_projection: bool = False,
    ) -> None:
        self.projections = (query, key, value)
        self.norms_over_projection = norms_over_projection
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling, self.query_norm, self.key_norm = scaling, query_norm, key_norm
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        with torch.no_grad():
            self.weight, self.bias = self._fused()

    def _fused(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        has_bias = self.projections[0].bias is not None
        bias = torch.cat([p.bias for p in self.projections]) if has_bias else None
        return torch.cat([p.weight for p in self.projections]), bias

    def refresh(self) -> None:
        with torch.no_grad():
            weight, bias = self._fused()
            self.weight.copy_(weight)
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)

    def __call__(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin = rope
        tokens, head_dim = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        q, k, v = F.linear(x, self.weight, self.bias).split([q_size, kv_size, kv_size], dim=-1)
        if self.norms_over_projection:
            q, k = self.query_norm(q), self.key_norm(k)  # type: ignore[misc]
        q = q.view(tokens, self.num_heads, head_dim)
        k = k.view(tokens, self.num_kv_heads, head_dim)
        if self.query_norm is not None and not self.norms_over_projection:
            q = self.query_norm(q)
        if self.key_norm is not None and not self.norms_over_projection:
            k = self.key_norm(k)
        if self.rotary_dim == head_dim:
            q, k = rotate(q, cos, sin).mul_(self.scaling), rotate(k, cos, sin)
        else:
            r = self.rotary_dim
            q = torch.cat([rotate(q[..., :r], cos, sin), q[..., r:]], dim=-1).mul_(self.scaling)
            k = torch.cat([rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        return q, k, v.view(tokens, self.num_kv_heads, head_dim)
