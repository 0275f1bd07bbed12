"""DeepSeek-V4's attention, a shared component: one shared key=value head with per-head sinks over a sliding window
of the sequence, plus compressed entries that each pool a window of `m` tokens (heavily compressed attention, HCA:
every entry; compressed sparse attention, CSA: m = 4 with overlapping windows, and a lightning indexer choosing the
top `index_topk` entries per query). As transformers 5.23's DeepseekV4Attention, DeepseekV4HCACompressor,
DeepseekV4CSACompressor and DeepseekV4Indexer compute it (release names: wq_a, q_norm, wq_b, wkv, kv_norm, wo_a,
wo_b, attn_sink, compressor.{wkv, wgate, ape, norm}, indexer.{wq_b, weights_proj, compressor.*}):

    q        = rms(wq_b(q_norm(wq_a(x))))_h, roped on its last qk_rope_head_dim dims (DeepSeek's interleaved pairs)
    kv       = rope(kv_norm(wkv(x)))                              one head, the keys and the values
    entry w  = rope_at(w m)(norm(sum_j softmax_j(wgate(x_j) + ape_j) wkv(x_j)))    over window w's tokens j
               (CSA: over [the previous window's first half-channels | this window's second half], 2m slots)
    out      = wo_b(wo_a_grouped(derope(softmax([q kv_s / sqrt(D) | sink_h]) kv)))   s: the window and the entries

A query at position t sees the keys at t - sliding_window < s <= t and the entries whose window lies at or before
t ((w + 1) m <= t + 1); under CSA only those its indexer chose. The output is rotated back by -t on its rope dims
(the values carry the keys' rotation).

Windows follow each sequence's positions (CompressionWindows): a row's left padding, or the other sequences of a
packed row, never fall into one. transformers' own forward cuts windows by the row's index instead, so its
left-padded rows differ from its unpadded ones (right padding is exact); moerl's equal each sequence alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.dsa import top_scored
from steps.models.hyper_connections import unweighted_rms_norm
from steps.models.layers import Float32RMSNorm, RecordedSelection, sink_attention


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated on its last 2 R dims in interleaved pairs by cos, sin [..., R] (one per pair, broadcast
    against x's leading dims), in float32, the leading dims kept (transformers' DeepSeek-V4 apply_rotary_pos_emb)."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rotary = cos.shape[-1]
    rest, rope = x[..., :-rotary], x[..., -rotary:]
    pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + pairs.float() * sin).to(x.dtype)
    return torch.cat([rest, rotated], dim=-1)


@dataclass
class CompressionWindows:
    """The complete windows of `rate` tokens of a forward's sequences, by row: window w of a sequence holds its
    positions [w rate, (w + 1) rate), all present in the row. `starts` [B, W] the row index of each window's first
    token, `present` [B, W] the real windows (rows have different counts), `positions` [B, W] the first token's
    position, `segments` [B, W] its sequence (None: one a row), `previous` [B, W] the index of the same sequence's
    window before it (-1: none)."""

    rate: int
    starts: torch.Tensor
    present: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor | None
    previous: torch.Tensor

    @classmethod
    def of(
        cls, valid: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor | None, rate: int
    ) -> CompressionWindows:
        """The windows of the tokens valid [B, T] at positions [B, T] (counted from each sequence's first token),
        of sequences `segments` [B, T] (None: one a row)."""
        batch, length = valid.shape
        index = torch.arange(length, device=valid.device)
        last = (index + rate - 1).clamp(max=length - 1).expand(batch, -1)
        whole = (
            valid
            & (positions % rate == 0)
            & (index + rate - 1 < length)
            & valid.gather(1, last)
            & (positions.gather(1, last) == positions + rate - 1)
        )
        if segments is not None:
            whole &= segments.gather(1, last) == segments
        counts = whole.sum(dim=1)
        count = int(counts.max()) if batch else 0
        order = torch.argsort((~whole).to(torch.int8), dim=1, stable=True)[:, :count]
        present = torch.arange(count, device=valid.device) < counts[:, None]
        starts = torch.where(present, order, torch.zeros_like(order))
        window_positions = positions.gather(1, starts)
        own = torch.arange(count, device=valid.device).expand(batch, -1)
        previous = torch.where(present & (window_positions > 0), own - 1, torch.full_like(own, -1))
        window_segments = None if segments is None else segments.gather(1, starts)
        return cls(rate, starts, present, window_positions, window_segments, previous)

    @property
    def count(self) -> int:
        return self.starts.shape[1]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """values [B, T, X] -> each window's tokens [B, W, rate, X]."""
        batch, length, width = values.shape
        index = (self.starts[..., None] + torch.arange(self.rate, device=values.device)).clamp(max=length - 1)
        flat = index.reshape(batch, -1, 1).expand(-1, -1, width)
        return values.gather(1, flat).view(batch, self.count, self.rate, width)

    def visible(self, query_positions: torch.Tensor, query_segments: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, W]: the windows each query sees, its sequence's windows that end at or before it."""
        seen = self.present[:, None, :] & (self.positions[:, None, :] + self.rate <= query_positions[..., None] + 1)
        if query_segments is not None and self.segments is not None:
            seen &= self.segments[:, None, :] == query_segments[..., None]
        return seen


class Compressor(nn.Module):
    """Pools each window into one entry of `head_dim` (DeepseekV4HCACompressor; `overlap`: DeepseekV4CSACompressor,
    whose projections are twice as wide and whose entry w pools window w - 1's first half-channels with window w's
    second). Release names: wkv, wgate, ape (the per-slot gate bias), norm."""

    def __init__(self, hidden_size: int, head_dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        width = 2 * head_dim if overlap else head_dim
        self.wkv = nn.Linear(hidden_size, width, bias=False)
        self.wgate = nn.Linear(hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width))
        self.norm = Float32RMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> each token's (kv, gate) [B, T, width]: what a window pools."""
        return self.wkv(x), self.wgate(x)

    def pool(
        self, kv: torch.Tensor, gate: torch.Tensor, windows: CompressionWindows, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """The entries [B, W, head_dim] of the windows over the tokens' projections kv, gate [B, T, width], normed
        and roped at each window's first position (rope: cos, sin [B, W, R] of the compress rotary there)."""
        chunk_kv, chunk_gate = windows.gather(kv), windows.gather(gate) + self.ape
        if self.overlap:
            d, m = self.head_dim, self.rate
            previous = windows.previous.clamp(min=0)
            has_previous = (windows.previous >= 0)[..., None, None]
            index = previous[..., None, None].expand(-1, -1, m, 2 * d)
            earlier_kv, earlier_gate = chunk_kv.gather(1, index), chunk_gate.gather(1, index)
            first_kv = torch.where(has_previous, earlier_kv[..., :d], torch.zeros_like(earlier_kv[..., :d]))
            first_gate = torch.where(has_previous, earlier_gate[..., :d], torch.full_like(earlier_gate[..., :d],
                                                                                          float("-inf")))  # fmt: skip
            chunk_kv = torch.cat([first_kv, chunk_kv[..., d:]], dim=2)
            chunk_gate = torch.cat([first_gate, chunk_gate[..., d:]], dim=2)
        weights = chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)
        entries = self.norm((chunk_kv * weights).sum(dim=2))
        return rotate_trailing(entries, *rope)


class Indexer(nn.Module):
    """CSA's lightning indexer (DeepseekV4Indexer): its own overlapping compressor at index_head_dim, queries
    wq_b(q_residual) roped at the query's position, scores sum_h w_h relu(q_h . k) / sqrt(index_head_dim) with
    w = weights_proj(x) / sqrt(index_n_heads), the top index_topk entries a query sees. Frozen, as DeepSeek sparse
    attention's indexer is (steps/models/dsa.py)."""

    def __init__(self, cfg: object, rate: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk  # type: ignore[attr-defined]
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)  # type: ignore[attr-defined]
        self.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)  # type: ignore[attr-defined]
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, rate, True, cfg.rms_norm_eps)  # type: ignore[attr-defined]
        # Frozen: its choice is discrete, so a log-prob loss gives it no gradient (transformers' gets none either;
        # DeepSeek trains it with a loss of its own): no gradient, no optimizer state, published as loaded.
        self.requires_grad_(False)

    def queries(self, q_residual: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q_residual [B, T, q_lora_rank] -> [B, T, heads, index_head_dim], roped at the queries' positions."""
        batch, length, _ = q_residual.shape
        q = self.wq_b(q_residual).view(batch, length, -1, self.head_dim).transpose(1, 2)
        return rotate_trailing(q, rope[0].unsqueeze(1), rope[1].unsqueeze(1)).transpose(1, 2)

    @torch.no_grad()
    def select(self, x: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[B, T, W] bool: the entries each query keeps, the top min(index_topk, W) of its scores among the visible
        ones (x [B, T, H] the queries' inputs, queries [B, T, heads, Di], keys [B, W, Di] the index entries). Scored
        a block of queries at a time (the per-head products are [B, T, heads, W])."""
        weights = self.weights_proj(x).float() * self.num_heads**-0.5

        def scores(rows: slice) -> torch.Tensor:
            per_head = torch.matmul(queries[:, rows].float(), keys.transpose(-1, -2).float().unsqueeze(1))
            return (F.relu(per_head) * self.head_dim**-0.5 * weights[:, rows].unsqueeze(-1)).sum(dim=2)

        return top_scored(scores, visible, min(self.topk, keys.shape[1]), x.shape[0] * self.num_heads * keys.shape[1])


class CompressedAttention(nn.Module):
    """DeepseekV4Attention under the release's names. `kind` is the layer's (sliding_attention,
    compressed_sparse_attention, heavily_compressed_attention): the sliding layers use the main rotary and no
    compressor; the others the compress rotary, a compressor and (CSA) an indexer."""

    def __init__(self, cfg: object, layer_idx: int) -> None:
        super().__init__()
        c = cfg
        self.layer_idx = layer_idx
        self.kind = c.layer_types[layer_idx]  # type: ignore[attr-defined]
        self.num_heads, self.head_dim = c.num_attention_heads, c.head_dim  # type: ignore[attr-defined]
        self.o_groups = c.o_groups  # type: ignore[attr-defined]
        self.sliding_window = c.sliding_window  # type: ignore[attr-defined]
        self.scaling = self.head_dim**-0.5
        self.eps = c.rms_norm_eps  # type: ignore[attr-defined]
        self.rope_kind = "main" if self.kind == "sliding_attention" else "compress"
        h = c.hidden_size  # type: ignore[attr-defined]
        self.wq_a = nn.Linear(h, c.q_lora_rank, bias=False)  # type: ignore[attr-defined]
        self.q_norm = Float32RMSNorm(c.q_lora_rank, self.eps)  # type: ignore[attr-defined]
        self.wq_b = nn.Linear(c.q_lora_rank, self.num_heads * self.head_dim, bias=False)  # type: ignore[attr-defined]
        self.wkv = nn.Linear(h, self.head_dim, bias=False)
        self.kv_norm = Float32RMSNorm(self.head_dim, self.eps)
        group_width = self.num_heads * self.head_dim // self.o_groups
        self.wo_a = nn.Linear(group_width, self.o_groups * c.o_lora_rank, bias=False)  # type: ignore[attr-defined]
        self.wo_b = nn.Linear(self.o_groups * c.o_lora_rank, h, bias=False)  # type: ignore[attr-defined]
        self.attn_sink = nn.Parameter(torch.empty(self.num_heads))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind != "sliding_attention":
            rate = c.compress_rate(layer_idx)  # type: ignore[attr-defined]
            csa = self.kind == "compressed_sparse_attention"
            self.compressor = Compressor(h, self.head_dim, rate, csa, self.eps)
            self.indexer = Indexer(c, rate) if csa else None
        # its place among the layers with an indexer (the engine's record is in that order)
        self.indexer_index = sum(kind == "compressed_sparse_attention" for kind in c.layer_types[:layer_idx])  # type: ignore[attr-defined]

    @property
    def rate(self) -> int | None:
        return None if self.compressor is None else self.compressor.rate

    def queries(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] (this layer's rotary at the tokens: cos, sin [B, T, R]) -> q [B, heads, T, D] (normed per
        head, roped) and the query latent q_residual [B, T, q_lora_rank] (the indexer's input)."""
        batch, length, _ = x.shape
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(batch, length, -1, self.head_dim).transpose(1, 2)
        return rotate_trailing(unweighted_rms_norm(q, self.eps), rope[0].unsqueeze(1), rope[1].unsqueeze(1)), q_residual

    def keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, T, H] -> the tokens' key=value kv [B, 1, T, D], normed and roped."""
        batch, length, _ = x.shape
        kv = self.kv_norm(self.wkv(x)).view(batch, length, 1, self.head_dim).transpose(1, 2)
        return rotate_trailing(kv, rope[0].unsqueeze(1), rope[1].unsqueeze(1))

    def attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """q [B, heads, T, D] over keys=values [B, 1, S, D] under mask [B, 1, T, S], with the sinks; the output
        rotated back at the queries' positions (rope: this layer's cos, sin [B, T, R]), grouped wo_a, wo_b ->
        [B, T, H]."""
        batch, _, length, _ = q.shape
        out = sink_attention(q, keys, keys, mask, self.attn_sink, self.scaling)
        out = rotate_trailing(out, rope[0].unsqueeze(1), -rope[1].unsqueeze(1)).transpose(1, 2)
        grouped = out.reshape(batch * length, self.o_groups, -1).transpose(0, 1)
        weight = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1]).transpose(1, 2)
        mixed = torch.bmm(grouped, weight).transpose(0, 1).reshape(batch, length, -1)
        return self.wo_b(mixed)

    def key_inputs(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> KeyInputs:
        """What the tokens x [B, T, H] give the keys' side (this layer's rotary at them)."""
        return KeyInputs(
            self.keys(x, rope),
            None if self.compressor is None else self.compressor.project(x),
            None if self.indexer is None else self.indexer.compressor.project(x),
        )


@dataclass
class KeyInputs:
    """The keys' side of a CompressedAttention call, per key slot [B, S, *]: the key=value kv [B, 1, S, D], and the
    compressor's and the indexer's projections (kv, gate) of the key tokens, which the windows pool (None where
    the layer has none). The training forward's keys are its queries' tokens; a response's in the shared-prompt
    forward its prompt's then its own (joined), and the torch engine's a row's cache with the new token's
    (appended)."""

    kv: torch.Tensor
    compressed: tuple[torch.Tensor, torch.Tensor] | None
    indexed: tuple[torch.Tensor, torch.Tensor] | None

    def select(self, rows: torch.Tensor) -> KeyInputs:
        """Rows `rows` of every tensor."""

        def pick(p: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
            return None if p is None else (p[0].index_select(0, rows), p[1].index_select(0, rows))

        return KeyInputs(self.kv.index_select(0, rows), pick(self.compressed), pick(self.indexed))

    def then(self, later: KeyInputs) -> KeyInputs:
        """These slots followed by `later`'s (same rows)."""

        def joined(a: tuple[torch.Tensor, torch.Tensor] | None, b: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
            return None if a is None or b is None else (torch.cat([a[0], b[0]], dim=1), torch.cat([a[1], b[1]], dim=1))

        return KeyInputs(torch.cat([self.kv, later.kv], dim=2), joined(self.compressed, later.compressed),
                         joined(self.indexed, later.indexed))  # fmt: skip


def compressed_attention(
    attn: CompressedAttention,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    compress_rope: tuple[torch.Tensor, torch.Tensor],
    window_rope: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
    windows: CompressionWindows | None,
    visible: torch.Tensor | None,
    keys: KeyInputs | None = None,
    engine: RecordedSelection | None = None,
    record: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The attention block on its normed input x [B, T, H] -> [B, T, H]: the queries over the keys (`keys`, else
    x's own tokens) under `mask` [B, 1, T, S] (causality and the sliding window), then over the windows' entries
    the queries see (visible [B, T, W]) or, under CSA, the indexer chose among them. rope: this layer's rotary at
    the queries; compress_rope: the compress rotary at the queries (the indexer's); window_rope(positions): the
    compress rotary at the windows' first positions. CSA only: `engine`, the rollout engine's recorded choice
    (compared with the indexer's, and with replay used instead: engine_choice); `record` (the torch engine's), a
    list the choice [B, T, W] is appended to."""
    q, q_residual = attn.queries(x, rope)
    keys = keys if keys is not None else attn.key_inputs(x, rope)
    kv = keys.kv
    if attn.compressor is not None:
        assert windows is not None and visible is not None and keys.compressed is not None
        at = window_rope(windows.positions)
        entries = attn.compressor.pool(*keys.compressed, windows, at)
        chosen = visible
        if attn.indexer is not None:
            assert keys.indexed is not None
            index_keys = attn.indexer.compressor.pool(*keys.indexed, windows, at)
            chosen = attn.indexer.select(x, attn.indexer.queries(q_residual, compress_rope), index_keys, visible)
            if engine is not None:
                chosen = engine.replayed(attn.indexer_index, chosen, engine_choice(engine, attn.indexer_index,
                                                                                   windows, visible))  # fmt: skip
            if record is not None:
                record.append(chosen)
        kv = torch.cat([kv, entries.unsqueeze(1)], dim=2)
        mask = torch.cat([mask, chosen.unsqueeze(1)], dim=-1)
    return attn.attend(q, kv, mask, rope)


def engine_choice(
    engine: RecordedSelection, index: int, windows: CompressionWindows, visible: torch.Tensor
) -> torch.Tensor:
    """The engine's recorded entries [B, T, W] in this call's windows: its record holds each query's choice by the
    sequence's window index (SelectionShape.over_windows), which a window's first position / rate gives."""
    recorded = engine.layer(index).to(visible.device)  # [B, T, columns]
    if recorded.shape[-1] == 0:
        return torch.zeros_like(visible)
    column = (windows.positions // windows.rate).clamp(max=recorded.shape[-1] - 1)
    return recorded.gather(-1, column[:, None, :].expand(-1, recorded.shape[1], -1)) & visible


def init_compressed_attention(module: nn.Module, std: float) -> None:
    """As DeepseekV4PreTrainedModel._init_weights: sinks and the compressors' gate biases (ape) zero."""
    if isinstance(module, CompressedAttention):
        module.attn_sink.zero_()
    elif isinstance(module, Compressor):
        module.ape.zero_()
