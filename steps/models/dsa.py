"""DeepSeek sparse attention's lightning indexer (DSA: DeepSeek-V3.2, and GLM-5, which shares one layer's selection
with the next), a shared component: for every query it scores the keys the query may see and keeps the top
`index_topk` of them; the layer's attention then runs over those keys only. As transformers 5.23's
DeepseekV32Indexer computes it (the bf16 reference without DeepSeek's Hadamard rotation, which preserves the dot
products, and without its FP8 scoring kernel):

    k_s      = rope(LayerNorm(wk(x_s)))                              one key of index_head_dim a token
    q_t,h    = rope(wq_b(q_resid_t))_h                               index_n_heads queries from the MLA query latent
    w_t,h    = weights_proj(x_t)_h / sqrt(index_n_heads)             in fp32 (transformers keeps weights_proj fp32)
    I[t, s]  = sum_h w_t,h relu(q_t,h . k_s / sqrt(index_head_dim))  in fp32
    selected = top min(index_topk, S) of I[t, :] over the keys t may see

with rope the half-split rotation of the first qk_rope_head_dim dims (the MLA attention itself rotates interleaved
pairs). Keys a query may not see score -inf and are never selected.

Numerics: the selection is discrete. Near-ties (a relu makes many scores exactly 0) can break differently between
two call shapes or two dtypes (a one-token decode step against a full forward; an FP8 engine against a bf16 or
fp32 trainer), which is why the engine's selection has to be replayed in training, as routing replay does for the
experts. Scores are computed in the same operations as transformers' (one matmul per query head block, the head
weights applied by a second matmul), so the same shapes give the same bits.

Training: the indexer runs under no_grad; a log-prob loss gives it no gradient (DeepSeek trains it with a KL to the
dense attention's distribution, a loss of its own), so its parameters stay frozen (frozen_parameters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.layers import rotate_half

INDEX_KEY_NORM_EPS = 1e-6  # DeepseekV32Indexer's k_norm: nn.LayerNorm(index_head_dim, eps=1e-6)


def rotate_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated over its first R dims by cos, sin [..., R] (half-split: apply_rotary_pos_emb), the rest
    kept; cos and sin broadcast against x's leading dims."""
    rotary = cos.shape[-1]
    rot, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


class LightningIndexer(nn.Module):
    """The indexer of one attention layer. Parameters under the checkpoints' names: wq_b [Hi * Di, q_lora_rank],
    wk [Di, H], k_norm (weight and bias [Di]), weights_proj [Hi, H]."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        index_n_heads: int,
        index_head_dim: int,
        qk_rope_head_dim: int,
        index_topk: int,
    ) -> None:
        super().__init__()
        if qk_rope_head_dim > index_head_dim:
            raise ValueError(f"qk_rope_head_dim {qk_rope_head_dim} exceeds index_head_dim {index_head_dim}")
        self.num_heads, self.head_dim = index_n_heads, index_head_dim
        self.rope_dim, self.topk = qk_rope_head_dim, index_topk
        self.softmax_scale = index_head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, index_n_heads * index_head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(index_head_dim, eps=INDEX_KEY_NORM_EPS)
        self.weights_proj = nn.Linear(hidden_size, index_n_heads, bias=False)
        self.requires_grad_(False)  # frozen: a log-prob loss gives it no gradient (module docstring)

    def keys(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] and the rotary tables [B, T, rope_dim] -> the index keys [B, T, Di]."""
        return rotate_first(self.k_norm(self.wk(hidden)), cos, sin)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The MLA query latent q_resid [B, T, q_lora_rank] -> the index queries [B, T, Hi, Di]."""
        batch, seq, _ = q_resid.shape
        q = self.wq_b(q_resid).view(batch, seq, self.num_heads, self.head_dim)
        return rotate_first(q, cos.unsqueeze(2), sin.unsqueeze(2))

    def head_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> each query head's weight [B, T, Hi] in fp32."""
        return self.weights_proj(hidden.to(self.weights_proj.weight.dtype)).float() * (self.num_heads**-0.5)

    def scores(self, queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores [B, T, S] of queries [B, T, Hi, Di] (weights [B, T, Hi]) against keys [B, S, Di], fp32."""
        per_head = torch.matmul(queries.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale
        return torch.matmul(weights.unsqueeze(-2), F.relu(per_head)).squeeze(-2)

    @torch.no_grad()
    def select(
        self,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        visible: torch.Tensor,
        keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The keys each query attends to: a bool mask [B, T, S], True at the top min(index_topk, S) scores among
        the keys the query may see (visible [B, T, S]: causality, padding, a packed row's own sequence).
        hidden, q_resid and rope are the queries' tokens'; keys [B, S, Di] (a decode step's cache) defaults to
        these tokens' own keys (a full forward: S = T)."""
        cos, sin = rope
        if keys is None:
            keys = self.keys(hidden, cos, sin)
        index = self.scores(self.queries(q_resid, cos, sin), self.head_weights(hidden), keys)
        index = index.masked_fill(~visible, float("-inf"))
        chosen = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, chosen, True) & visible
