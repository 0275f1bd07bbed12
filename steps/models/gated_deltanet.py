"""Gated DeltaNet linear attention (Yang et al. 2024), the layer Qwen3-Next and Qwen3.5-MoE use in 3 of every 4
decoder layers: a shared component, as transformers' Qwen3NextGatedDeltaNet and Qwen3_5MoeGatedDeltaNet compute it.

Per token t and value head h, with q and k L2-normalised and q scaled by 1/sqrt(key head dim), the state S
[key dim, value dim] (fp32) is decayed by exp(g_t), corrected towards v_t along k_t with rate beta_t, then read by q_t:
    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t
with g_t = -exp(A_log) softplus(a_t + dt_bias) <= 0 and beta_t = sigmoid(b_t). q, k and v come out of a depthwise
causal conv1d (kernel 4, SiLU) over one projection of the hidden state; the output is a gated RMSNorm of o_t
(weight * rmsnorm(o) * silu(z), per value head) and out_proj. Each key head serves num_value_heads / num_key_heads
consecutive value heads.

Read top to bottom: the math as plain functions (the conv and its decode step, the delta rule's chunked training
form and its one-token decode form, the gated norm), the two checkpoint layouts' converters, the module.

Packed rows (trainer.sequence_packing): `segment_ids` [B, T] marks several sequences one after another in a row.
No conv tap and no state crosses a boundary, so each sequence gets exactly what it gets alone (transformers' torch
fallback ignores cu_seqlens and leaks the state from one sequence into the next).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# (conv_state [B, conv channels, K], recurrent_state [B, value heads, key head dim, value head dim] in fp32)
DeltaNetState = tuple[torch.Tensor, torch.Tensor]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norms and the delta rule: fp32 for fp32 and narrower inputs (as transformers), fp64 kept."""
    return torch.promote_types(dtype, torch.float32)


def positions_in_segment(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids [B, T] -> each token's index within its sequence (a run of one id; a row starts a sequence)."""
    batch, seq = segment_ids.shape
    index = torch.arange(seq, device=segment_ids.device).expand(batch, seq)
    first = torch.ones_like(segment_ids, dtype=torch.bool)
    first[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return index - torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values


# ---------------------------------------------------------------------------------------------------------------
# The short convolution


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU of the depthwise causal conv of x [B, T, C] by weight [C, K] (no bias) -> [B, T, C], as transformers'
    causal_conv1d_fn: out_t = sum_k weight[:, k] * x_{t-K+1+k}, the inputs before the first zero.

    segment_ids [B, T]: a tap that would reach into the previous sequence reads zero instead, as the sequence's
    own left padding. conv_state [B, C, K] (a decode state, causal_conv1d_step): the inputs before x instead of
    zeros (its last K-1 are read). Written as K shifted multiply-adds (K is 4): the same arithmetic with and
    without segments, so a packed sequence's result is the one it gets alone. Accumulated and activated in fp32,
    as the causal-conv1d CUDA kernel does (transformers' torch fallback convolves in the weight's dtype: in bf16
    the two differ by bf16 rounding).
    """
    if segment_ids is not None and conv_state is not None:
        raise ValueError("causal_conv1d: segment_ids with a conv_state (a packed row starts from zeros)")
    kernel = weight.shape[-1]
    dtype, seq = x.dtype, x.shape[1]
    compute = _compute_dtype(dtype)
    weight, x = weight.to(compute), x.to(compute)
    if conv_state is not None:
        x = torch.cat([conv_state[:, :, 1:].transpose(1, 2).to(compute), x], dim=1)
    padded = F.pad(x, (0, 0, kernel - 1, 0))
    width = x.shape[1]
    lag_ok = None if segment_ids is None else positions_in_segment(segment_ids)[..., None]
    out = torch.zeros_like(x)
    for k in range(kernel):
        lag = kernel - 1 - k
        tap = padded[:, k : k + width] * weight[:, k]
        if lag_ok is not None and lag > 0:
            tap = tap.masked_fill(lag_ok < lag, 0.0)
        out = out + tap
    return F.silu(out[:, -seq:]).to(dtype)


def causal_conv1d_step(
    x_t: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token x_t [B, C] -> (SiLU(conv) [B, C], new conv_state [B, C, K]).

    The state holds the last K pre-conv inputs, channels first, as transformers' cache and causal_conv1d_update
    (K, not K-1: the oldest is dropped unread on the next step; the layout is the causal-conv1d kernels')."""
    new_state = torch.cat([conv_state[:, :, 1:], x_t[:, :, None].to(conv_state.dtype)], dim=-1)
    compute = _compute_dtype(x_t.dtype)
    out = (new_state.to(compute) * weight.to(compute)).sum(-1)
    return F.silu(out).to(x_t.dtype), new_state


# ---------------------------------------------------------------------------------------------------------------
# The gated delta rule


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: transformers' l2norm (FLA's), eps inside the root."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_to_value_heads(q: torch.Tensor, k: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> [..., Hv, Dk]: key head h serves value heads h*r .. h*r+r-1 (repeat_interleave)."""
    groups = value_heads // q.shape[-2]
    if groups == 1:
        return q, k
    return q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)


def _chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    resets: list[bool] | None = None,
    keep: list[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The chunked delta rule over q, k [B, H, N, C, Dk] (q scaled), v [B, H, N, C, Dv], g, beta [B, H, N, C]
    (N chunks of C tokens) from state [B, H, Dk, Dv] -> (out [B, H, N, C, Dv], final state, the states after the
    chunks `keep` marks). `resets[i]`: the state is zero before chunk i (a sequence starts there).

    Within a chunk the C delta-rule updates are one UT transform (the WY representation): with
    A = strictly_lower((beta k) k^T * decay(i <- j)), u = (I + A)^-1 (beta v) and w = (I + A)^-1 (beta k exp(cum g))
    are what each token writes before and after subtracting the old state's prediction, v_new = u - w S."""
    chunk = q.shape[-2]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    # decay(i <- j) = exp(cum_i - cum_j) for j <= i; the upper triangle is masked before exp (it would overflow)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair
    q_read = q * cum.exp()[..., None]  # reads the state as decayed up to each token
    k_write = k * (cum[..., -1:] - cum).exp()[..., None]  # each token's write, decayed to the chunk's end
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs, kept = [], []
    for i in range(q.shape[2]):
        if resets is not None and resets[i]:
            state = torch.zeros_like(state)
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_read[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ v_new
        if keep is not None and keep[i]:
            kept.append(state)
    return torch.stack(outs, dim=2), state, kept


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a sequence in chunks (the training form; equal to the token-by-token recurrence,
    gated_delta_rule_step, as transformers' torch_chunk_gated_delta_rule without the L2 norm in it).

    q, k [B, T, Hk, Dk] (already L2-normalised; q is scaled by Dk^-0.5 here), v [B, T, Hv, Dv], g (log decay,
    <= 0) and beta [B, T, Hv], initial_state [B, Hv, Dk, Dv] -> (out [B, T, Hv, Dv] in v's dtype, final state in
    fp32 (fp64 for fp64 inputs)). Without segment_ids the final state is [B, Hv, Dk, Dv].

    segment_ids [B, T]: packed rows, the state starts from zero at each sequence's first token and the final
    state is one per sequence, [S, Hv, Dk, Dv] in row-major order (initial_state is refused with them). Method:
    each sequence is moved to start on a chunk boundary (its tail padded with zeros, as the last chunk of any
    sequence is), and the state is zeroed before its first chunk. So every chunk holds one sequence and does
    exactly the arithmetic that sequence gets alone: cumulative decays start at its own first token. (Masking
    the decay instead, g = -inf at a first token, is exact in the recurrence but not in chunks: cum_i - cum_j
    becomes -inf - -inf = NaN, and a large finite stand-in leaves an fp32 cumsum offset that rounds every later
    decay of the chunk.) The cost is up to chunk_size - 1 padding tokens per sequence.
    """
    batch, seq, _, key_dim = k.shape
    value_heads, value_dim = v.shape[-2:]
    out_dtype = v.dtype
    dtype = _compute_dtype(q.dtype)
    q, k = _heads_to_value_heads(q, k, value_heads)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q = q * key_dim**-0.5

    if segment_ids is None:
        resets = keep = slot = None
        pad = (chunk_size - seq % chunk_size) % chunk_size
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
        rows = batch
    else:
        if initial_state is not None:
            raise ValueError("gated_delta_rule_chunked: initial_state with segment_ids (each sequence starts at 0)")
        if segment_ids.shape != (batch, seq):
            raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} != {(batch, seq)}")
        first = torch.ones(batch, seq, dtype=torch.bool, device=q.device)
        first[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        sequence = first.reshape(-1).long().cumsum(0) - 1  # each token's sequence, row-major
        lengths = torch.bincount(sequence)
        chunks = (lengths + chunk_size - 1) // chunk_size
        first_chunk = chunks.cumsum(0) - chunks
        token_start = lengths.cumsum(0) - lengths
        slot = first_chunk[sequence] * chunk_size + torch.arange(batch * seq, device=q.device) - token_start[sequence]
        total = int(chunks.sum())
        resets = [False] * total
        for c in first_chunk.tolist():
            resets[c] = True
        keep = [False] * total
        for c in (first_chunk + chunks - 1).tolist():
            keep[c] = True

        def realign(x: torch.Tensor) -> torch.Tensor:
            flat = x.reshape(batch * seq, *x.shape[2:])
            return flat.new_zeros(total * chunk_size, *x.shape[2:]).index_copy(0, slot, flat)[None]

        q, k, v, g, beta = (realign(x) for x in (q, k, v, g, beta))
        rows = 1

    # [rows, L, H, ...] -> [rows, H, N, C, ...]
    q, k, v = (x.transpose(1, 2).reshape(rows, value_heads, -1, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(rows, value_heads, -1, chunk_size) for x in (g, beta))
    if initial_state is None:
        state = q.new_zeros(rows, value_heads, key_dim, value_dim)
    else:
        state = initial_state.to(dtype)
    out, state, kept = _chunk_scan(q, k, v, g, beta, state, resets, keep)
    out = out.reshape(rows, value_heads, -1, value_dim).transpose(1, 2)
    if slot is None:
        return out[:, :seq].to(out_dtype), state
    out = out[0].index_select(0, slot).reshape(batch, seq, value_heads, value_dim)
    return out.to(out_dtype), torch.cat(kept)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule (the decode form, transformers' torch_recurrent_gated_delta_rule per step):
    q, k [B, Hk, Dk] (L2-normalised; q scaled here), v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv, Dk, Dv]
    -> (out [B, Hv, Dv] in v's dtype, new state in fp32)."""
    out_dtype = v.dtype
    dtype = _compute_dtype(q.dtype)
    q, k = _heads_to_value_heads(q, k, v.shape[-2])
    q, k, v, g, beta, state = (x.to(dtype) for x in (q, k, v, g, beta, state))
    q = q * q.shape[-1] ** -0.5
    state = state * g.exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(dim=-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(dim=-2)
    return out.to(out_dtype), state


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate) over the last dim, as Qwen3NextRMSNormGated: normalised in fp32 and cast
    back before the weight (a plain weight, initialised to ones: not the (1 + w) of the decoder's RMSNorm), the
    gate's SiLU in fp32, the product cast to x's dtype."""
    dtype = x.dtype
    compute = _compute_dtype(dtype)
    x32 = x.to(compute)
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.to(compute))).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint layouts. GatedDeltaNet's one input projection stacks its output rows as
#   q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv) | b (Hv) | a (Hv)
# heads in order within each: the conv's channels (q, k, v) first, as Qwen3.5 stores its four projections.


def from_grouped_projections(
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    num_key_heads: int,
    num_value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
) -> torch.Tensor:
    """Qwen3-Next's two projections -> the fused projection weight [P, H]. qkvz [2*Hk*Dk + 2*Hv*Dv, H] holds, per
    key head group h in turn, q_h (Dk rows), k_h (Dk), the group's r = Hv/Hk value heads' v (r*Dv) and z (r*Dv);
    ba [2*Hv, H] per group its r b rows, then its r a rows (transformers' fix_query_key_value_ordering)."""
    r = num_value_heads // num_key_heads
    hidden = qkvz.shape[-1]
    groups = qkvz.reshape(num_key_heads, 2 * key_head_dim + 2 * r * value_head_dim, hidden)
    q, k, v, z = groups.split([key_head_dim, key_head_dim, r * value_head_dim, r * value_head_dim], dim=1)
    b, a = ba.reshape(num_key_heads, 2 * r, hidden).split([r, r], dim=1)
    return torch.cat([x.reshape(-1, hidden) for x in (q, k, v, z, b, a)])


def to_grouped_projections(
    fused: torch.Tensor, num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused projection weight -> Qwen3-Next's (qkvz, ba): the inverse of from_grouped_projections."""
    hidden = fused.shape[-1]
    key_rows, value_rows = num_key_heads * key_head_dim, num_value_heads * value_head_dim
    q, k, v, z, b, a = fused.split([key_rows, key_rows, value_rows, value_rows, num_value_heads, num_value_heads])
    per_group = [x.reshape(num_key_heads, -1, hidden) for x in (q, k, v, z, b, a)]
    qkvz = torch.cat(per_group[:4], dim=1).reshape(-1, hidden)
    ba = torch.cat(per_group[4:], dim=1).reshape(-1, hidden)
    return qkvz, ba


def from_separate_projections(
    qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    num_key_heads: int,
    num_value_heads: int,
    key_head_dim: int,
    value_head_dim: int,
) -> torch.Tensor:
    """Qwen3.5's four projections, qkv [2*Hk*Dk + Hv*Dv, H] (all q heads, all k heads, all v heads), z [Hv*Dv, H],
    b and a [Hv, H] -> the fused projection weight: already its order, stacked (the head counts check shapes)."""
    expected = (2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim, num_value_heads * value_head_dim)
    if (qkv.shape[0], z.shape[0], b.shape[0], a.shape[0]) != (*expected, num_value_heads, num_value_heads):
        raise ValueError(f"projection rows {qkv.shape[0]}, {z.shape[0]}, {b.shape[0]}, {a.shape[0]} do not fit "
                         f"{num_key_heads} key heads of {key_head_dim} and {num_value_heads} value heads of "
                         f"{value_head_dim}")  # fmt: skip
    return torch.cat([qkv, z, b, a])


def to_separate_projections(
    fused: torch.Tensor, num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection weight -> Qwen3.5's (qkv, z, b, a): the inverse of from_separate_projections."""
    conv_rows = 2 * num_key_heads * key_head_dim + num_value_heads * value_head_dim
    qkv, z, b, a = fused.split([conv_rows, num_value_heads * value_head_dim, num_value_heads, num_value_heads])
    return qkv, z, b, a


# ---------------------------------------------------------------------------------------------------------------
# The layer


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention of hidden [B, T, H] -> [B, T, H] (Qwen3NextGatedDeltaNet's arithmetic).

    Parameters: `projection` (the fused input projection, rows q | k | v | z | b | a, see the converters above),
    `conv_weight` [conv channels, 1, K] (the checkpoint's conv1d weight as stored), `A_log` and `dt_bias` [Hv],
    `norm_weight` [Dv] (the gated norm's plain weight) and `out_proj`. Training: forward (padding or packed rows).
    Decode: init_state, prefill, step; a state is (conv_state, recurrent_state), see DeltaNetState.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        linear_num_key_heads: int,
        linear_num_value_heads: int,
        linear_key_head_dim: int,
        linear_value_head_dim: int,
        linear_conv_kernel_dim: int = 4,
        rms_norm_eps: float = 1e-6,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        if linear_num_value_heads % linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {linear_num_key_heads}")  # fmt: skip
        self.num_key_heads, self.num_value_heads = linear_num_key_heads, linear_num_value_heads
        self.key_head_dim, self.value_head_dim = linear_key_head_dim, linear_value_head_dim
        self.key_dim = linear_num_key_heads * linear_key_head_dim
        self.value_dim = linear_num_value_heads * linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = linear_conv_kernel_dim
        self.eps = rms_norm_eps
        self.chunk_size = chunk_size
        self.projection = nn.Linear(
            hidden_size, self.conv_dim + self.value_dim + 2 * linear_num_value_heads, bias=False
        )
        bound = linear_conv_kernel_dim**-0.5  # nn.Conv1d's default init for a depthwise kernel
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, linear_conv_kernel_dim).uniform_(-bound, bound))
        self.A_log = nn.Parameter(torch.empty(linear_num_value_heads).uniform_(0.01, 16).log())
        self.dt_bias = nn.Parameter(torch.ones(linear_num_value_heads))
        self.norm_weight = nn.Parameter(torch.ones(linear_value_head_dim))
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @classmethod
    def from_config(cls, cfg: Any, chunk_size: int = 64) -> GatedDeltaNet:
        """The layer of a config with config.json's names (hidden_size, linear_num_key_heads, ...)."""
        names = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps")  # fmt: skip
        return cls(**{name: getattr(cfg, name) for name in names}, chunk_size=chunk_size)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [..., H] -> the projection's (qkv conv input, z, b, a)."""
        heads = self.num_value_heads
        return self.projection(x).split([self.conv_dim, self.value_dim, heads, heads], dim=-1)

    def _heads(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [..., conv channels] and b, a [..., Hv] -> q, k [..., Hk, Dk] (L2-normalised in fp32),
        v [..., Hv, Dv], g and beta [..., Hv]. As transformers: beta = sigmoid(b) in the model's dtype, g in fp32
        (A_log.float(): exp(A_log) could overflow in fp16)."""
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        dtype = _compute_dtype(mixed.dtype)
        q = l2norm(q.unflatten(-1, (self.num_key_heads, self.key_head_dim)).to(dtype))
        k = l2norm(k.unflatten(-1, (self.num_key_heads, self.key_head_dim)).to(dtype))
        v = v.unflatten(-1, (self.num_value_heads, self.value_head_dim))
        g = -self.A_log.float().exp() * F.softplus(a.to(dtype) + self.dt_bias)
        return q, k, v, g, b.sigmoid()

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core [..., Hv, Dv] and z [..., Hv*Dv] -> out_proj(gated norm per value head) [..., H]."""
        gate = z.unflatten(-1, (self.num_value_heads, self.value_head_dim))
        normed = gated_rms_norm(core, gate, self.norm_weight, self.eps)
        return self.out_proj(normed.flatten(-2))

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [B, T, H] -> [B, T, H] from a zero state (training and scoring).

        attention_mask [B, T]: padding's hidden states are zeroed, as transformers does: with zero inputs a
        padding token writes nothing (k = 0) into a zero state, so left padding is exact and right padding never
        reaches a real token; padding between real tokens is not supported (it would decay their state).
        segment_ids [B, T]: packed rows, each sequence as alone (causal_conv1d, gated_delta_rule_chunked)."""
        return self._forward(hidden, attention_mask, segment_ids, None)[0]

    def _forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        segment_ids: torch.Tensor | None,
        state: DeltaNetState | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            hidden = (hidden * attention_mask[:, :, None]).to(hidden.dtype)
        mixed, z, b, a = self._split(hidden)
        conv_state, recurrent = (None, None) if state is None else state
        conv = causal_conv1d(mixed, self.conv_weight[:, 0], segment_ids, conv_state)
        q, k, v, g, beta = self._heads(conv, b, a)
        core, final = gated_delta_rule_chunked(q, k, v, g, beta, segment_ids, self.chunk_size, recurrent)
        return self._output(core, z), mixed, final

    def init_state(self, batch: int, device: torch.device | None = None) -> DeltaNetState:
        """The zero state of `batch` sequences: conv_state [B, conv channels, K] in the weights' dtype (the last K
        pre-conv inputs, as transformers' cache) and recurrent_state [B, Hv, Dk, Dv] in fp32."""
        weight = self.conv_weight
        device = weight.device if device is None else device
        conv_state = torch.zeros(batch, self.conv_dim, self.kernel, dtype=weight.dtype, device=device)
        recurrent = torch.zeros(batch, self.num_value_heads, self.key_head_dim, self.value_head_dim,
                                dtype=_compute_dtype(weight.dtype), device=device)  # fmt: skip
        return conv_state, recurrent

    def prefill(
        self, hidden: torch.Tensor, state: DeltaNetState | None = None, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, DeltaNetState]:
        """hidden [B, T, H] continuing `state` (init_state's when None) -> (out [B, T, H], the state after it):
        a prompt in chunks, the same as T steps. attention_mask [B, T]: left padding only (see forward)."""
        if state is None:
            state = self.init_state(hidden.shape[0], hidden.device)
        out, mixed, recurrent = self._forward(hidden, attention_mask, None, state)
        conv_state = torch.cat([state[0], mixed.transpose(1, 2).to(state[0].dtype)], dim=-1)[:, :, -self.kernel :]
        return out, (conv_state, recurrent)

    def step(self, hidden_t: torch.Tensor, state: DeltaNetState) -> tuple[torch.Tensor, DeltaNetState]:
        """One decode token hidden_t [B, H] -> (out [B, H], new state); the state passed in is not changed."""
        conv_state, recurrent = state
        mixed, z, b, a = self._split(hidden_t)
        conv, conv_state = causal_conv1d_step(mixed, conv_state, self.conv_weight[:, 0])
        q, k, v, g, beta = self._heads(conv, b, a)
        core, recurrent = gated_delta_rule_step(q, k, v, g, beta, recurrent)
        return self._output(core, z), (conv_state, recurrent)
