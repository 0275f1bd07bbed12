"""gpt-oss's layers in plain PyTorch, matching transformers 5.23's GptOssForCausalLM: its experts and sparse block,
attention with sinks, decoder layer and causal LM.

Read top to bottom: the norm (RMSNorm with the weight applied in fp32 before the cast back, Float32RMSNorm), the
experts (the shared expert kind ClampedSwiGLU, steps/models/moe.py: biased, gate and up interleaved in one
[H, 2I] matrix, x @ W layout, as GptOssExperts holds expert e's slice) and the MoE block (the shared
SparseMoeBlock with router kind "topk_softmax": a router with a bias, top-k of the logits, softmax over the k),
attention (grouped-query with q/k/v/o biases, YaRN rotary tables, per-head sinks: an extra logit in each head's
softmax, dropped after it; the layer's sliding window from layer_types, applied by the shared masks), the decoder
layer and the causal LM (the shared skeleton, steps/models/causal_lm.py). Module names are the checkpoint's except
the router (`mlp.gate` here, `mlp.router` there) and the experts (one module per expert here, one fused tensor per
weight there): the state-dict adapter maps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from steps.models.causal_lm import DecoderLayer, MoeCausalLM
from steps.models.experts import ClampedSwiGLU, RoutedExpert
from steps.models.gpt_oss.config import GptOssConfig
from steps.models.gpt_oss.rope import rotary_cos_sin
from steps.models.layers import Float32RMSNorm, sink_attention
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Expert(RoutedExpert):
    """One gpt-oss expert (GptOssExperts' slice e): gate_up_proj [H, 2I] (gate columns even, up columns odd) and
    its bias [2I], down_proj [I, H] and its bias [H]; computed by the shared ClampedSwiGLU kind."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.empty(hidden_size))
        self.arithmetic = ClampedSwiGLU(alpha, limit)

    def expert_weights(self) -> list[torch.Tensor]:
        return [self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias]


class MoeBlock(SparseMoeBlock):
    """gpt-oss's sparse block (GptOssMLP): the router `gate` (weight and bias; the checkpoint's `router`) and the
    experts `experts.{e}` this rank holds."""

    expert_class = Expert


def moe_block(cfg: GptOssConfig, slots: Sequence[int] | None = None, ep_rank: int = 0, ep_size: int = 1) -> MoeBlock:
    """A layer's GptOssMLP: top num_experts_per_tok of the biased router's logits, softmax over them."""
    return MoeBlock(
        cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
        norm_topk_prob=False, slots=slots, ep_rank=ep_rank, ep_size=ep_size,
        router=RouterSettings(kind="topk_softmax"),
        expert_kwargs={"alpha": cfg.swiglu_alpha, "limit": cfg.swiglu_limit},
    )  # fmt: skip


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)



class Attention(nn.Module):
    """Grouped-query attention with q/k/v/o biases (attention_bias), YaRN rotary tables, attention sinks and the
    layer's sliding window (GptOssAttention)."""

    def __init__(self, cfg: GptOssConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.sliding_window = cfg.window(layer_idx)  # the shared masks apply it (steps/models/layers.py)
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and rope (cos, sin) [B, T, D] -> q [B, heads, T, D], k and v [B, kv_heads, T, D], q and k
        rotated (gpt-oss's half-split rotation, in rotate-half form)."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention with sinks of q [B, heads, T, D] over k/v [B, kv_heads, S, D], then o_proj ->
        [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = sink_attention(q, k, v, mask, self.sinks, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def decoder_layer(
    cfg: GptOssConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> DecoderLayer:
    """GptOssDecoderLayer: attention, then the sparse block (every layer is sparse)."""
    slots, ep_size = layer_share(cfg, placement, layer_idx)
    norms = Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), Float32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return DecoderLayer(Attention(cfg, layer_idx), moe_block(cfg, slots, ep_rank, ep_size), *norms)


class GptOssCausalLM(MoeCausalLM):
    """gpt-oss causal LM (steps/models/causal_lm.py). state_dict() keys are the model's names; the state-dict
    adapter maps them to a Hugging Face gpt-oss checkpoint's."""

    config: GptOssConfig

    def __init__(self, config: GptOssConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: Float32RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    @torch.no_grad()
    def init_weights(self) -> None:
        """The shared initialisation, then the router's bias normal(0, initializer_range) as transformers (the
        shared one zeroes Linear biases)."""
        super().init_weights()
        if not self.model.norm.weight.is_meta:
            for block in self.moe_blocks():
                block.gate.bias.normal_(0.0, self.config.initializer_range)

    def init_extra(self, module: nn.Module) -> None:
        """As GptOssPreTrainedModel._init_weights: sinks and the experts' matrices normal(0, initializer_range);
        the experts' biases zero."""
        std = self.config.initializer_range
        if isinstance(module, Attention):
            module.sinks.normal_(0.0, std)
        elif isinstance(module, Expert):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
            module.gate_up_proj_bias.zero_()
            module.down_proj_bias.zero_()

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(self.config, positions, dtype)
