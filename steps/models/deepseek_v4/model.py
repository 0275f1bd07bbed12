"""DeepSeek-V4's layers in plain PyTorch, matching transformers 5.23's DeepseekV4ForCausalLM, under the release's
names (state_dict_adapter.py adds the `model.` prefix's and the few names moerl's shared modules spell otherwise):

    layers.N.hc_attn / hc_ffn        hyper-connections around each block (steps/models/hyper_connections.py)
    layers.N.attn_norm, attn         the attention (steps/models/compressed_attention.py): sliding window, sinks,
                                     compressed entries (HCA), chosen by an indexer (CSA)
    layers.N.ffn_norm, ffn           the MoE block: 1 shared + top-k routed clamped-SwiGLU experts (w1, w2, w3); the
                                     router scores sqrt(softplus) with a correction bias, or, in the hash layers,
                                     takes the experts from a fixed table by token (ffn.gate.tid2eid)
    hc_head, norm, head              the streams collapsed, normed and projected

The residual stream is hc_mult streams [B, T, N, H] from the embedding (copied N times) to the head. Read top to
bottom: the experts and the MoE block, the rotaries, the decoder layer (forward, and the shared-prompt forward,
whose responses' compressed windows run over prompt and response tokens), the causal LM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import MoeCausalLM
from steps.models.compressed_attention import (
    CompressedAttention,
    CompressionWindows,
    KeyInputs,
    compressed_attention,
    init_compressed_attention,
)
from steps.models.deepseek_v4.config import CSA, DeepseekV4Config
from steps.models.experts import LimitedSwiGLU, SwiGLUExpert
from steps.models.hyper_connections import HyperConnection, HyperHead, init_hyper_connection
from steps.models.layers import AttentionMasks, Float32RMSNorm, SelectionShape
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share
from steps.models.rope import yarn_frequencies

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Expert(SwiGLUExpert):
    """One DeepSeek-V4 expert under the release's names (w1 gate, w3 up, w2 down), SwiGLU with its pre-activations
    clamped to swiglu_limit (the kind LimitedSwiGLU); also the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float = 10.0) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.arithmetic = LimitedSwiGLU(limit)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.w1, self.w3, self.w2


class MoeBlock(SparseMoeBlock):
    """DeepseekV4SparseMoeBlock: the shared block (router kind sqrtsoftplus_topk, its correction bias a buffer) with
    one shared expert; a hash layer's router keeps no bias but a fixed table gate.tid2eid [vocab, k] (a buffer,
    published unchanged) and routes token t to tid2eid[t], still weighing those experts by its scores. `token_ids`
    (set by the layer before each call) are the tokens of the rows it is given."""

    expert_class = Expert

    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, slots: Any, ep_rank: int, ep_size: int) -> None:
        router = RouterSettings("sqrtsoftplus_topk", routed_scaling_factor=cfg.routed_scaling_factor)
        super().__init__(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.norm_topk_prob, slots, ep_rank, ep_size, router=router,
            shared_intermediate_size=cfg.moe_intermediate_size, expert_kwargs={"limit": cfg.swiglu_limit},
        )  # fmt: skip
        assert isinstance(self.shared_experts, Expert)
        self.shared_experts.arithmetic = LimitedSwiGLU(cfg.swiglu_limit)  # the shared block builds it without kwargs
        self.hash_routed = cfg.is_hash_layer(layer_idx)
        self.router_chooses = not self.hash_routed
        if self.hash_routed:
            del self.gate.e_score_correction_bias
            self.gate.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        self.token_ids: torch.Tensor | None = None

    def choose(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.hash_routed:
            return super().choose(hidden)
        if self.token_ids is None or self.token_ids.numel() != hidden.shape[0]:
            raise RuntimeError("a hash-routed MoE layer needs the token ids of the rows it routes (MoeBlock.token_ids)")
        router_logits = F.linear(hidden.float(), self.gate.weight.float())
        scores = F.softplus(router_logits).sqrt()
        return router_logits, scores, self.gate.tid2eid[self.token_ids.reshape(-1)].long()


@dataclass
class Rotaries:
    """DeepSeek-V4's two rotaries at a forward's token positions, cos and sin [B, T, R / 2] (one per interleaved
    pair): "main" (the sliding layers) and "compress" (the compressed layers, their compressors and indexers);
    `at(positions, kind)` the same at other positions (the compressed windows')."""

    main: tuple[torch.Tensor, torch.Tensor]
    compress: tuple[torch.Tensor, torch.Tensor]
    at: Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]

    def __getitem__(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.main if kind == "main" else self.compress


def rotary_tables(cfg: DeepseekV4Config, device: torch.device | str) -> dict[str, tuple[torch.Tensor, float]]:
    """Each rotary's (inv_freq [R / 2], the factor cos and sin are multiplied by) over qk_rope_head_dim dims:
    main default RoPE at rope_theta; compress at compress_rope_theta, YaRN when rope_scaling says so with its
    attention factor 1 (transformers' DeepseekV4Config forces it: the reference applies no mscale)."""
    dim = cfg.qk_rope_head_dim
    main = yarn_frequencies(dim, cfg.rope_theta, None, device)
    yarn = None if cfg.rope_scaling is None else {**cfg.rope_scaling, "attention_factor": 1.0}
    return {"main": main, "compress": yarn_frequencies(dim, cfg.compress_rope_theta, yarn, device)}


def rotaries(cfg: DeepseekV4Config, positions: torch.Tensor, dtype: torch.dtype) -> Rotaries:
    tables = rotary_tables(cfg, positions.device)

    def at(where: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, factor = tables[kind]
        freqs = where[..., None].float() * inv_freq
        return (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)

    return Rotaries(at(positions, "main"), at(positions, "compress"), at)


def windows_of(masks: AttentionMasks, rate: int) -> CompressionWindows:
    """The forward's compression windows at `rate` over its keys (built once per forward and rate)."""
    key = ("compression_windows", rate)
    windows = masks.layouts.get(key)
    if windows is None:
        windows = masks.layouts[key] = CompressionWindows.of(masks.key_valid, masks.key_positions, masks.segments, rate)
    return windows  # type: ignore[return-value]


class DecoderLayer(nn.Module):
    """DeepseekV4DecoderLayer under the release's names: attn_norm, attn, ffn_norm, ffn, and the hyper-connections
    hc_attn, hc_ffn; `mlp` (the shared code's name) is ffn."""

    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, placement: ExpertPlacement | None, ep_rank: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        slots, ep_size = layer_share(cfg, placement, layer_idx)
        self.attn_norm, self.ffn_norm = Float32RMSNorm(h, eps), Float32RMSNorm(h, eps)
        self.attn = CompressedAttention(cfg, layer_idx)
        self.ffn = MoeBlock(cfg, layer_idx, slots, ep_rank, ep_size)
        connection = (cfg.hc_mult, h, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*connection), HyperConnection(*connection)

    @property
    def mlp(self) -> MoeBlock:
        return self.ffn

    def attention(
        self,
        h: torch.Tensor,
        rope: Rotaries,
        masks: AttentionMasks,
        keys: KeyInputs | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The attention block on its normed input h [B, T, H], over the keys `masks` describes (keys: their
        inputs, else h's tokens): the sliding window's, then the compressed entries the queries see (or their
        indexer chose; the engine's recorded choice in masks.engine_selection compared and replayed; record: the
        torch engine's list of choices)."""
        attn = self.attn
        windows = visible = None
        if attn.rate is not None:
            windows = windows_of(masks, attn.rate)
            visible = windows.visible(masks.query_positions, masks.segments)
        return compressed_attention(
            attn, h, rope[attn.rope_kind], rope["compress"], lambda at: rope.at(at, "compress"),
            masks.get(attn.sliding_window), windows, visible, keys, masks.engine_selection, record,
        )  # fmt: skip

    def feed_forward(self, streams: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        """The MoE block with its hyper-connection on streams [.., N, H] of tokens token_ids (same leading shape)."""
        post, comb, collapsed = self.hc_ffn(streams)
        self.ffn.token_ids = token_ids
        try:
            out = self.ffn(self.ffn_norm(collapsed))
        finally:
            self.ffn.token_ids = None
        return HyperConnection.mix(post, comb, out, streams)

    def forward(self, x: torch.Tensor, rope: Rotaries, masks: AttentionMasks) -> torch.Tensor:
        post, comb, collapsed = self.hc_attn(x)
        x = HyperConnection.mix(post, comb, self.attention(self.attn_norm(collapsed), rope, masks), x)
        return self.feed_forward(x, masks.token_ids)

    def forward_shared_prompts(
        self,
        prompt_x: torch.Tensor,
        response_x: torch.Tensor,
        prompt_rope: Rotaries,
        response_rope: Rotaries,
        prompt_masks: AttentionMasks,
        response_masks: AttentionMasks,
        prompt_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As causal_lm.DecoderLayer.forward_shared_prompts: prompts [G, P, N, H] attend among themselves, responses
        [R, T, N, H] to their prompt's keys and their own; a response's compressed windows run over its prompt's
        tokens and its own (the compressors' projections of the prompt tokens computed once, then gathered)."""
        attn = self.attn
        post_p, comb_p, collapsed_p = self.hc_attn(prompt_x)
        post_r, comb_r, collapsed_r = self.hc_attn(response_x)
        hp, hr = self.attn_norm(collapsed_p), self.attn_norm(collapsed_r)
        prompt_keys = attn.key_inputs(hp, prompt_rope[attn.rope_kind])
        prompt_out = self.attention(hp, prompt_rope, prompt_masks, prompt_keys)
        keys = prompt_keys.select(prompt_index).then(attn.key_inputs(hr, response_rope[attn.rope_kind]))
        response_out = self.attention(hr, response_rope, response_masks, keys)
        prompt_x = HyperConnection.mix(post_p, comb_p, prompt_out, prompt_x)
        response_x = HyperConnection.mix(post_r, comb_r, response_out, response_x)
        # One MoE call over the prompts' and the responses' tokens, as every family's shared-prompt forward
        n, hidden = prompt_x.shape[-2:]
        streams = torch.cat([prompt_x.reshape(-1, 1, n, hidden), response_x.reshape(-1, 1, n, hidden)])
        assert prompt_masks.token_ids is not None and response_masks.token_ids is not None
        ids = torch.cat([prompt_masks.token_ids.reshape(-1, 1), response_masks.token_ids.reshape(-1, 1)])
        out = self.feed_forward(streams, ids)
        count = prompt_x.shape[0] * prompt_x.shape[1]
        return out[:count].view_as(prompt_x), out[count:].view_as(response_x)


class DeepseekV4ForCausalLM(MoeCausalLM):
    """DeepSeek-V4 causal LM (steps/models/causal_lm.py) with the residual widened to hc_mult streams: `embed` copies
    each embedding into them, `final_norm` collapses them (hc_head) before the norm. state_dict() keys are the
    release's tensor names under moerl's `model.` layout (state_dict_adapter.py)."""

    config: DeepseekV4Config

    def __init__(self, config: DeepseekV4Config, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps)
        self.build(
            lambda layer: DecoderLayer(config, layer, placement, ep_rank),
            lambda: Float32RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.config.hc_mult, x.shape[-1]).contiguous()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.norm(self.hc_head(x))

    def init_extra(self, module: nn.Module) -> None:
        """As DeepseekV4PreTrainedModel._init_weights: the hyper-connections' fn normal, base 0, scale 1; sinks and
        the compressors' gate biases zero; the correction bias and the hash table zero (the table's values come
        from the checkpoint)."""
        std = self.config.initializer_range
        init_hyper_connection(module, std)
        init_compressed_attention(module, std)
        if isinstance(module, MoeBlock):
            if module.hash_routed:
                module.gate.tid2eid.zero_()
            else:
                module.gate.e_score_correction_bias.zero_()

    def selection_shape(self) -> SelectionShape | None:
        """The CSA layers' indexers choose index_topk of their compressed entries, recorded by window index."""
        layers = sum(kind == CSA for kind in self.config.layer_types)
        rate = self.config.compress_rates[CSA]
        return SelectionShape(layers, self.config.index_topk, rate, over_windows=True) if layers else None

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotaries:  # type: ignore[override]
        return rotaries(self.config, positions, dtype)
