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

with rope the half-split rotation of the first qk_rope_head_dim dims (DeepSeek-V3.2; GLM-5's indexer rotates
DeepSeek's interleaved pairs, as the MLA attention itself does). Keys a query may not see score -inf and are never
selected. GLM-5 runs the indexer in some layers only: a "shared" layer attends to the keys the last layer with an
indexer selected (the config's indexer_source).

Numerics: the selection is discrete. Near-ties (a relu makes a score exactly 0 wherever every head's product is
negative: common with few index heads) can break differently between two call shapes or two dtypes: a one-token
decode step against a full forward, an FP8 engine against a bf16 or fp32 trainer. transformers' own forward is not
causal there (appending a token changes the length topk runs over, and with it which of several zero-scored keys an
earlier query keeps), nor is moerl's. Exact agreement needs the engine's selection replayed in training, as routing
replay does for the experts: with rollout.record_routes the torch engine records, beside the routes, the keys every
query past index_topk attended to in each layer with an indexer (IndexedDecode.recorded; Generation.selected_keys),
and the trainer's forward compares its indexers' choice with it (RecordedSelection.disagreement) and, with
trainer.routing_replay: rollout, attends to the engine's keys instead (IndexedMlaAttention.with_engine_selection).
Scores are computed in the same operations as transformers' (one matmul per query head
block, the head weights applied by a second matmul), so the same shapes give the same bits.

Training: the indexer runs under no_grad; a log-prob loss gives it no gradient (DeepSeek trains it with a KL to the
dense attention's distribution, a loss of its own), so its parameters are frozen (requires_grad off: no gradient,
no optimizer state; published as loaded).

Read top to bottom: the indexer, multi-head latent attention with an indexer (IndexedMlaAttention), the decoder
layer that applies the selection (in the training forward, over packed rows, and in the shared-prompt forward), and
the torch engine's incremental forward (IndexedDecode: a StatefulDecode holding each row's keys, values and index
keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import DecoderLayer, MoeCausalLM, mlp_over_prompts_and_responses
from steps.models.layers import AttentionMasks, RecordedSelection, attention_mask_for, rotate_half
from steps.models.mla import MlaAttention, deinterleave

INDEX_KEY_NORM_EPS = 1e-6  # DeepseekV32Indexer's k_norm: nn.LayerNorm(index_head_dim, eps=1e-6)
SCORE_BLOCK_ELEMENTS = 2**26  # per-head products scored at once (fp32: 256 MB), see LightningIndexer.select


def rotate_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [..., D] rotated over its first R dims by cos, sin [..., R] (half-split: apply_rotary_pos_emb; interleaved:
    its pairs de-interleaved first, apply_rotary_pos_emb_interleave), the rest kept; cos and sin broadcast against
    x's leading dims."""
    rotary = cos.shape[-1]
    rot, rest = x[..., :rotary], x[..., rotary:]
    if interleaved:
        rot = deinterleave(rot)
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
        interleaved_rope: bool = False,
    ) -> None:
        super().__init__()
        self.interleaved_rope = interleaved_rope
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
        return rotate_first(self.k_norm(self.wk(hidden)), cos, sin, self.interleaved_rope)

    def queries(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The MLA query latent q_resid [B, T, q_lora_rank] -> the index queries [B, T, Hi, Di]."""
        batch, seq, _ = q_resid.shape
        q = self.wq_b(q_resid).view(batch, seq, self.num_heads, self.head_dim)
        return rotate_first(q, cos.unsqueeze(2), sin.unsqueeze(2), self.interleaved_rope)

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
        these tokens' own keys (a full forward: S = T).

        The per-head products [B, queries, Hi, S] are what a long sequence's memory goes to (8k tokens and 64 heads:
        17 GB a row at once), so the queries are scored SCORE_BLOCK_ELEMENTS at a time; a query's scores do not
        depend on the other queries of its block."""
        cos, sin = rope
        if keys is None:
            keys = self.keys(hidden, cos, sin)
        queries, weights = self.queries(q_resid, cos, sin), self.head_weights(hidden)
        return top_scored(lambda rows: self.scores(queries[:, rows], weights[:, rows], keys), visible,
                          min(self.topk, keys.shape[1]), hidden.shape[0] * self.num_heads * keys.shape[1])  # fmt: skip


def top_scored(
    scores: Callable[[slice], torch.Tensor], visible: torch.Tensor, count: int, per_query: int
) -> torch.Tensor:
    """[B, T, S] bool: each query's `count` best-scored keys among the visible ones (visible [B, T, S]), an
    indexer's choice (LightningIndexer, and DeepSeek-V4's, steps/models/compressed_attention.py). scores(rows) gives
    a block of queries' scores [B, rows, S], SCORE_BLOCK_ELEMENTS of their per_query intermediate elements at a
    time; a query's scores do not depend on the other queries of its block."""
    selected = torch.zeros_like(visible)
    if count == 0:
        return selected
    block = max(1, SCORE_BLOCK_ELEMENTS // max(1, per_query))
    for start in range(0, visible.shape[1], block):
        rows = slice(start, start + block)
        index = scores(rows).masked_fill(~visible[:, rows], float("-inf"))
        selected[:, rows].scatter_(-1, index.topk(count, dim=-1).indices, True)
    return selected & visible


def indexer_source(cfg: Any, layer: int) -> int:
    """The layer whose indexer selects layer `layer`'s keys: itself, or (GLM-5's shared layers: the config's
    indexer_source) an earlier one."""
    source = getattr(cfg, "indexer_source", None)
    return layer if source is None else int(source(layer))


class IndexedMlaAttention(MlaAttention):
    """Multi-head latent attention with a lightning indexer (`indexer`), as DeepseekV32Attention: the indexer reads
    the layer's input and the query latent q_a_layernorm(q_a_proj(x)) (so q_lora_rank is required). A layer that
    reuses an earlier layer's selection (`source` < layer_idx) has no indexer (GlmMoeDsaAttention)."""

    def __init__(self, cfg: Any, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if self.q_a_proj is None:
            raise ValueError("DeepSeek sparse attention reads the query latent: q_lora_rank is required")
        self.source = indexer_source(cfg, layer_idx)
        # its place among the layers with an indexer of their own (the engine's record is in that order)
        self.indexer_index = sum(indexer_source(cfg, earlier) == earlier for earlier in range(layer_idx))
        # whether a later layer reuses this layer's selection (GLM-5): only then is it kept for the forward
        self.shared = any(
            indexer_source(cfg, later) == layer_idx for later in range(layer_idx + 1, cfg.num_hidden_layers)
        )
        self.indexer: LightningIndexer | None = None
        if self.source == layer_idx:
            self.indexer = LightningIndexer(
                cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim,
                cfg.index_topk, bool(getattr(cfg, "indexer_rope_interleave", False)),
            )  # fmt: skip

    def selection(
        self,
        hidden: torch.Tensor,
        latent: torch.Tensor,
        rope: Any,
        visible: torch.Tensor,
        selections: dict[int, torch.Tensor],
        keys: torch.Tensor | None = None,
        engine: RecordedSelection | None = None,
    ) -> torch.Tensor:
        """The keys this layer's queries attend to [B, T, S]: its indexer's choice, or with the engine's record
        replayed (`engine` with replay) the engine's at every recorded query (kept in `selections` for the layers
        that share it); a layer without an indexer takes its source layer's from `selections`."""
        if self.indexer is None:
            return selections[self.source]
        selected = self.indexer.select(hidden, latent, rope, visible, keys)
        if engine is not None:
            selected = self.with_engine_selection(selected, visible, engine)
        if self.shared:  # [B, T, S] a layer: kept only for the layers that read it
            selections[self.layer_idx] = selected
        return selected

    def with_engine_selection(
        self, own: torch.Tensor, visible: torch.Tensor, engine: RecordedSelection
    ) -> torch.Tensor:
        """own [B, T, S] with the engine's recorded selection at its recorded queries when engine.replay (own
        otherwise); counts the recorded queries where the two differ (RecordedSelection.disagreement)."""
        chosen = engine.layer(self.indexer_index, own.shape[-1]).to(own.device) & visible
        return engine.replayed(self.indexer_index, own, chosen)

    def project_indexed(
        self, x: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """project, and the query latent [B, T, q_lora_rank] the indexer reads."""
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        latent = self.q_a_layernorm(self.q_a_proj(x))
        return (*self.project_queries(x, self.q_b_proj(latent), rope_tables), latent)


class IndexedDecoderLayer(DecoderLayer):
    """x + self_attn(input_layernorm(x)) over the keys the indexer selects, then + mlp(post_attention_layernorm(x)).
    self_attn is an IndexedMlaAttention."""

    def forward(self, x: torch.Tensor, rope: Any, masks: AttentionMasks) -> torch.Tensor:
        attn = self.self_attn
        h = self.input_layernorm(x)
        q, k, v, latent = attn.project_indexed(h, rope)
        selected = attn.selection(h, latent, rope, masks.get(None)[:, 0], masks.selections,
                                  engine=masks.engine_selection)  # fmt: skip
        x = x + attn.attend(q, k, v, selected[:, None])
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_shared_prompts(
        self,
        prompt_x: torch.Tensor,
        response_x: torch.Tensor,
        prompt_rope: Any,
        response_rope: Any,
        prompt_masks: AttentionMasks,
        response_masks: AttentionMasks,
        prompt_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward_shared_prompts, each response's queries selecting among its prompt's keys and its
        own (the index keys concatenated as the keys and values are)."""
        attn = self.self_attn
        hp, hr = self.input_layernorm(prompt_x), self.input_layernorm(response_x)
        qp, kp, vp, latent_p = attn.project_indexed(hp, prompt_rope)
        qr, kr, vr, latent_r = attn.project_indexed(hr, response_rope)
        k = torch.cat([kp.index_select(0, prompt_index), kr], dim=2)
        v = torch.cat([vp.index_select(0, prompt_index), vr], dim=2)
        index_p = index_keys = None
        if attn.indexer is not None:
            with torch.no_grad():
                index_p, index_r = attn.indexer.keys(hp, *prompt_rope), attn.indexer.keys(hr, *response_rope)
                index_keys = torch.cat([index_p.index_select(0, prompt_index), index_r], dim=1)
        prompt_selected = attn.selection(hp, latent_p, prompt_rope, prompt_masks.get(None)[:, 0],
                                         prompt_masks.selections, keys=index_p,
                                         engine=prompt_masks.engine_selection)  # fmt: skip
        response_selected = attn.selection(hr, latent_r, response_rope, response_masks.get(None)[:, 0],
                                           response_masks.selections, keys=index_keys,
                                           engine=response_masks.engine_selection)  # fmt: skip
        prompt_x = prompt_x + attn.attend(qp, kp, vp, prompt_selected[:, None])
        response_x = response_x + attn.attend(qr, k, v, response_selected[:, None])
        return mlp_over_prompts_and_responses(self, prompt_x, response_x)


# ---------------------------------------------------------------------------------------------------------------
# The torch engine's incremental forward (attention kind indexed_kv_cache; steps/engines/state_decoder.py drives it)


@dataclass
class IndexedRows:
    """Every layer's (keys, values, index keys) of the rows: [R, heads, S, *], [R, heads, S, v_dim], [R, S, Di];
    `valid` [R, S] the real slots (a prompt's left padding is not)."""

    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    valid: torch.Tensor


class IndexedDecode:
    """StatefulDecode (steps/models/family.py) of a causal LM whose layers are IndexedDecoderLayers, reading its
    modules (weights updated in place are seen). The prefill runs each layer as the forward does over left-padded
    prompts; a step feeds one token a row, its indexer choosing among the row's cached index keys, so the logits
    equal the full forward's up to float rounding and the indexer's tie-breaks (dsa.py's module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        assert isinstance(model, MoeCausalLM)
        self.model = model
        # While a list (the torch engine's record, steps/engines/route_recorder.py SelectionRecorder): every forward
        # appends the selection [R, T, S] of each layer with an indexer of its own, in layer order
        self.recorded: list[torch.Tensor] | None = None

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.model.model.norm(x), self.model.output_weight()).float()

    @staticmethod
    def _index_keys(attn: IndexedMlaAttention, h: torch.Tensor, rope: Any) -> torch.Tensor:
        """The tokens' index keys [R, T, Di]; [R, T, 0] for a layer without an indexer (it reuses a selection)."""
        if attn.indexer is None:
            return h.new_zeros(*h.shape[:2], 0)
        return attn.indexer.keys(h, *rope)

    def _record(self, attn: IndexedMlaAttention, selected: torch.Tensor) -> None:
        if self.recorded is not None and attn.indexer is not None:
            self.recorded.append(selected)

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, IndexedRows]:
        """Left-padded prompts [P, T] -> logits after each prompt's last token [P, V] and the rows' state."""
        x = self.model.model.embed_tokens(ids)
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        rope = self.model.rotary(positions, x.dtype)
        visible = attention_mask_for(valid, 0, ids.shape[1])[:, 0]
        layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        selections: dict[int, torch.Tensor] = {}
        for layer in self.model.model.layers:
            assert isinstance(layer, IndexedDecoderLayer)
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q, k, v, latent = attn.project_indexed(h, rope)
            index_keys = self._index_keys(attn, h, rope)
            selected = attn.selection(h, latent, rope, visible, selections, keys=index_keys)
            self._record(attn, selected)
            x = x + attn.attend(q, k, v, selected[:, None])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            layers.append((k, v, index_keys))
        return self._logits(x[:, -1]), IndexedRows(layers, valid)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, state: IndexedRows) -> tuple[torch.Tensor, Any]:
        """One token a row at `positions` [R] -> logits [R, V] and the state after it (a new IndexedRows)."""
        x = self.model.model.embed_tokens(tokens)[:, None]  # [R, 1, H]
        rope = self.model.rotary(positions[:, None], x.dtype)
        valid = torch.cat([state.valid, torch.ones_like(state.valid[:, :1])], dim=1)
        visible = valid[:, None, :]  # the new token sees every real slot, itself included
        layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        selections: dict[int, torch.Tensor] = {}
        for layer, (keys, values, index_keys) in zip(self.model.model.layers, state.layers, strict=True):
            attn, h = layer.self_attn, layer.input_layernorm(x)
            q, k, v, latent = attn.project_indexed(h, rope)
            keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
            index_keys = torch.cat([index_keys, self._index_keys(attn, h, rope)], dim=1)
            selected = attn.selection(h, latent, rope, visible, selections, keys=index_keys)
            self._record(attn, selected)
            x = x + attn.attend(q, keys, values, selected[:, None])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            layers.append((keys, values, index_keys))
        return self._logits(x[:, 0]), IndexedRows(layers, valid)

    def select(self, state: IndexedRows, rows: torch.Tensor) -> IndexedRows:
        return IndexedRows(
            [tuple(t.index_select(0, rows) for t in layer) for layer in state.layers],  # type: ignore[misc]
            state.valid.index_select(0, rows),
        )


def decode_model(model: nn.Module) -> Any:
    """A DSA family's StatefulDecode (its ModelFamily.decode)."""
    return IndexedDecode(model)
