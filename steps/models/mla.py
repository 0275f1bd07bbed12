"""Multi-head latent attention (DeepSeek-V2/V3's MLA), a shared component of the families that have it (DeepSeek-V3
and Kimi-K2, DeepSeek-V3.2): its rotary embedding over the qk_rope_head_dim dims of each head (default or YaRN
frequencies, the YaRN attention factor, the softmax scale with YaRN's mscale, the interleaved layout), the attention
module and the torch engine's projection of it. The config is read by duck typing (DeepSeek's config.json names:
qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank, q_lora_rank, rope_theta, rope_scaling,
rope_interleave, attention_bias).

The rope arithmetic is transformers' (modeling_rope_utils.py _compute_yarn_parameters, shared in
steps/models/rope.py; modeling_deepseek_v3.py yarn_apply_mscale and apply_rotary_pos_emb_interleave), in the same
float32 operations. The torch engine's cache holds the per-head keys and values, not the latent (kv_lora_rank +
qk_rope_head_dim per token, what SGLang's MLA kernels cache): simple and exact, at heads * (qk_head_dim + v_head_dim)
/ (kv_lora_rank + qk_rope_head_dim) times the memory per token (about 70x for DeepSeek-V3's sizes), fine for the tiny
models the torch engine serves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from steps.models.decoding import rotate
from steps.models.layers import RMSNorm, softmax_attention
from steps.models.rope import scaled_cos_sin, yarn_frequencies, yarn_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepseekV3RMSNorm's default eps, not rms_norm_eps


def inv_freq_and_attention_factor(cfg: Any, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """The rotary frequencies [qk_rope_head_dim / 2] and the factor cos and sin are multiplied by."""
    return yarn_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, device)


def softmax_scale(cfg: Any) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared when mscale_all_dim is set."""
    scale = cfg.qk_head_dim ** (-0.5)
    yarn = cfg.rope_scaling
    if yarn is not None and yarn.get("mscale_all_dim"):
        m = yarn_mscale(yarn["factor"], yarn["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rotary_cos_sin(cfg: Any, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, qk_rope_head_dim] (both halves share the frequencies), times the
    attention factor, computed in fp32 and cast to dtype (DeepseekV3RotaryEmbedding)."""
    inv_freq, attention_factor = inv_freq_and_attention_factor(cfg, positions.device)
    return scaled_cos_sin(positions, inv_freq, attention_factor, dtype)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dims in DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the
    half-split layout rotate_half rotates. Rotating that equals apply_rotary_pos_emb_interleave, whose output is
    in the half-split layout too."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MlaAttention(nn.Module):
    """Multi-head latent attention, as DeepseekV3Attention.

    q: q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with q_lora_rank; per head [q_nope | q_rope].
    kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim, one for all heads)];
    kv_b_proj(kv_a_layernorm(latent)) = per head [k_nope | v]. k = [k_nope | k_rope] per head.
    q_rope and k_rope are rotated (in the interleaved layout when rope_interleave); the softmax scale is
    qk_head_dim ** -0.5 times YaRN's mscale squared (softmax_scale)."""

    def __init__(self, cfg: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = None
        self.num_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = cfg.qk_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave
        self.scaling = softmax_scale(cfg)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> the queries [..., heads * qk_head_dim], before the rotation."""
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary dims x [..., rope_dim] rotated (apply_rotary_pos_emb or its interleaved form)."""
        if self.interleave:
            x = deinterleave(x)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def project(
        self, x: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and (cos, sin) [B, T, rope_dim] -> q, k [B, heads, T, qk_head_dim], v [B, heads, T, v_dim]."""
        return self.project_queries(x, self.queries(x), rope_tables)

    def project_queries(
        self, x: torch.Tensor, queries: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """project, given the queries [B, T, heads * qk_head_dim] before the rotation (a caller that also needs
        the query latent computes them itself)."""
        batch, seq, _ = x.shape
        cos, sin = (t.unsqueeze(1) for t in rope_tables)  # broadcast over the heads
        q = queries.view(batch, seq, self.num_heads, self.qk_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(batch, seq, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = self.rotate(k_rope.unsqueeze(1), cos, sin)  # [B, 1, T, rope_dim]: shared by the heads
        q = torch.cat([q_nope, self.rotate(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, qk_head_dim] over k/v [B, heads, S, *], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling)  # keys wider than values: the kernels take both
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.v_dim))


class MlaProjection:
    """Multi-head latent attention's q, k and v for the decoder (a DecodeProjection): x [T, H] (normed) and a
    RotaryTable's (cos, sin_folded) [T, 1, qk_rope_head_dim] -> q [T, heads, qk_head_dim] times the softmax
    scale, k [T, heads, qk_head_dim] (k_nope per head, the shared rotated k_rope repeated), v [T, heads,
    v_head_dim], as Attention.project computes them. The rope dims are de-interleaved before the rotation when
    rope_interleave (deinterleave), as in the forward. It reads the attention's modules directly, so an
    in-place weight update needs no refresh."""

    def __init__(self, attn: MlaAttention) -> None:
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
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q = torch.cat([q_nope, rotate(q_rope, cos, sin)], dim=-1).mul_(a.scaling)
        k = torch.cat([k_nope, rotate(k_rope, cos, sin).expand(-1, a.num_heads, -1)], dim=-1)
        return q, k, v.contiguous()
