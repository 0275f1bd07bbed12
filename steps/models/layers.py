"""Building blocks the families share: RMSNorm, rotary embedding, and softmax attention over a key/value cache
(the attention kind "softmax_kv_cache", steps/models/family.py): its masks (causal, after a prompt, sliding
windows) and its arithmetic. A family's layers hold the parameters under its own names and call these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.kernels import grouped_attention, rms_norm
from steps.models.rope import default_frequencies


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as Qwen3MoeRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Float32RMSNorm(RMSNorm):
    """x / rms(x) computed in fp32, times the weight still in fp32, then cast back (GptOssRMSNorm, DeepseekV4RMSNorm;
    Qwen3's casts before the weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * hidden).to(x.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, head_dim], computed in fp32 (both halves share the frequencies)."""
    inv_freq = default_frequencies(head_dim, theta, positions.device)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the last dim's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated over its first R dims by cos, sin [B, T, R] (rotate-half form), the other D - R
    dims kept: transformers' apply_rotary_pos_emb of GLM-4-MoE and MiniMax-M2 (partial rotary)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


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


@dataclass(frozen=True)
class SelectionShape:
    """What a model's indexers choose, as the engine records it and the trainer checks and lays it out: `layers`
    indexers, each query past the first few choosing `topk` of its keys. DeepSeek sparse attention (steps/models/
    dsa.py) chooses among the sequence's tokens (rate 1; a query at position t sees t + 1 keys); DeepSeek-V4's
    compressed sparse attention (steps/models/compressed_attention.py) among its compressed entries, one every `rate`
    tokens (a query at t sees (t + 1) // rate), recorded by the sequence's window index (`over_windows`)."""

    layers: int
    topk: int
    rate: int = 1
    over_windows: bool = False

    def keys(self, fed: int) -> int:
        """The keys the last of `fed` tokens sees: a sample's key columns."""
        return fed // self.rate

    @property
    def first_query(self) -> int:
        """The first position that sees more than topk keys: the queries recorded start there."""
        return self.rate * (self.topk + 1) - 1

    def queries(self, fed: int) -> int:
        """A sample's recorded queries, positions first_query .. fed - 1."""
        return max(0, fed - self.first_query)


@dataclass
class RecordedSelection:
    """The keys the rollout engine's indexers selected for one forward call's queries (DeepSeek sparse attention,
    steps/models/dsa.py, and DeepSeek-V4's compressed sparse attention; recorded and replayed with the routes,
    trainer.routing_replay), laid out as the call's queries [B, T] and keys [S] are (DeepSeek-V4's: by the
    sequence's window index): `bits` [indexer layers, B, T, ceil(S / 8)] uint8, key s of a query at bit s
    (np.packbits, big-endian); `recorded` [B, T] the queries with a record (those that see more than index_topk
    keys). With `replay` the forward attends to those keys instead of its own indexers' choice. `disagreement`
    holds, per indexer layer, [recorded queries whose own top-k differs from the engine's, recorded queries],
    written (not added) by the layer's forward, so a rerun by activation checkpointing does not count twice."""

    bits: torch.Tensor
    recorded: torch.Tensor
    replay: bool
    disagreement: dict[int, torch.Tensor] = field(default_factory=dict)

    def layer(self, index: int, keys: int | None = None) -> torch.Tensor:
        """Indexer layer `index`'s selection as a bool [B, T, keys] (every recorded column when None)."""
        shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=self.bits.device)
        return ((self.bits[index].unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :keys]

    def replayed(self, index: int, own: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Indexer layer `index`'s choice [B, T, S] given its own `own` and the engine's `chosen` in the same
        layout: the engine's at the recorded queries with replay, else own; counts where they differ."""
        recorded = self.recorded.to(own.device)
        differs = ((chosen != own).any(dim=-1) & recorded).sum()
        self.disagreement[index] = torch.stack([differs, recorded.sum()])
        return torch.where(recorded[..., None], chosen, own) if self.replay else own


class AttentionMasks:
    """The boolean attention masks [B, 1, T, S] of one forward: the causal one every layer starts from, and per
    sliding window the same restricted to keys fewer than `window` positions before the query (as transformers'
    sliding-window mask: key position > query position - window), built once per window and forward.

    Also the queries' token layout, for the layers that read it instead of a mask (a recurrent layer, such as gated
    DeltaNet, steps/models/gated_deltanet.py): `valid` [B, T] the real tokens, `segments` [B, T] the packed
    sequences' ids (None when a row is one sequence)."""

    def __init__(
        self,
        base: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        valid: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> None:
        self.base = base
        self.query_positions, self.key_positions = query_positions, key_positions
        self.valid, self.segments = valid, segments
        self.key_valid = valid  # the keys' real tokens [B, S] (after_prompt: the prompt's, then the queries')
        self._windowed: dict[int, torch.Tensor] = {}
        # The keys each query of a DeepSeek-sparse-attention layer selected ([B, T, S], by layer index), for the
        # later layers that reuse a layer's selection (GLM-5's shared indexer layers, steps/models/dsa.py): one
        # forward's, so that a layer run again by activation checkpointing reads what it read the first time.
        self.selections: dict[int, torch.Tensor] = {}
        # The rollout engine's recorded selection for this forward's queries (selection replay), set by the model
        self.engine_selection: RecordedSelection | None = None
        # The queries' token ids [B, T] (set by the model: DeepSeek-V4's hash-routed MoE layers choose experts by
        # token), and layouts a family derives from this forward's tokens once for all its layers (DeepSeek-V4's
        # compression windows, by rate)
        self.token_ids: torch.Tensor | None = None
        self.layouts: dict[object, object] = {}

    @classmethod
    def causal(cls, valid: torch.Tensor, positions: torch.Tensor) -> AttentionMasks:
        """Tokens valid [B, T] at positions [B, T] attending among themselves (attention_mask_for)."""
        return cls(attention_mask_for(valid, 0, valid.shape[1]), positions, positions, valid)

    @classmethod
    def after_prompt(
        cls,
        prompt_valid: torch.Tensor,
        prompt_positions: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
    ) -> AttentionMasks:
        """Response tokens valid [R, T] attending to their prompt's real tokens [R, P] (all of them: the prompt
        comes first), then to their own causally: [R, 1, T, P + T]."""
        sees_prompt = prompt_valid[:, None, None, :].expand(-1, 1, valid.shape[1], prompt_valid.shape[1])
        base = torch.cat([sees_prompt, attention_mask_for(valid, 0, valid.shape[1])], dim=-1)
        masks = cls(base, positions, torch.cat([prompt_positions, positions], dim=1), valid)
        masks.key_valid = torch.cat([prompt_valid, valid], dim=1)
        return masks

    @classmethod
    def packed(cls, valid: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor) -> AttentionMasks:
        """Sequences packed into rows without padding (trainer.sequence_packing): tokens valid [B, T] of segments
        [B, T] (each sequence its own id, contiguous) attend causally within their own segment only; positions
        [B, T] count from each segment's start. The same mask per sequence as causal() gives it alone."""
        base = attention_mask_for(valid, 0, valid.shape[1])
        same = segments[:, None, :, None] == segments[:, None, None, :]
        return cls(base & same, positions, positions, valid, segments)

    def get(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.base
        mask = self._windowed.get(window)
        if mask is None:
            near = self.key_positions[:, None, None, :] > self.query_positions[:, None, :, None] - window
            mask = self._windowed[window] = self.base & near
        return mask


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention with sinks (transformers' eager_attention_forward of gpt-oss and DeepSeek-V4): q [B, heads, T, D]
    over k/v [B, kv_heads, S, D] under a boolean mask [B, 1, T, S] (or [B, heads, T, S]), with sinks [heads] as one
    more logit per head and query, dropped after the softmax -> [B, heads, T, D]. One key/value head (DeepSeek-V4's
    shared K=V) is broadcast over the query heads, not copied."""
    if k.shape[1] > 1:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
