"""Qwen2-MoE's layers in plain PyTorch, matching transformers' Qwen2MoeForCausalLM: its experts (Qwen2MoeMLP) and
sparse block with a sigmoid-gated shared expert, attention with q/k/v biases, the decoder layer and the causal LM.

Module names are the checkpoint's tensor names except the shared expert: the shared block (steps/models/moe.py)
names it `shared_experts`, the checkpoint `shared_expert`; the state-dict adapter (state_dict_adapter.py) maps
the two.

Read top to bottom: the experts and the MoE block (the shared SparseMoeBlock with this family's experts, router
kind softmax_topk, one shared expert scaled by sigmoid(shared_expert_gate(x))), attention (the shared
softmax_kv_cache kind, no q/k norm, default RoPE), the decoder layer and the causal LM (the shared skeleton,
steps/models/causal_lm.py, with this family's parts; the rollout engine decodes through decode.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import DecoderLayer, MoeCausalLM
from steps.models.experts import SwiGLUExpert
from steps.models.layers import RMSNorm, rotary_cos_sin, softmax_attention
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share
from steps.models.qwen2_moe.config import Qwen2MoeConfig

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Expert(SwiGLUExpert):
    """One SwiGLU feed-forward block, down(silu(gate(x)) * up(x)), named as Qwen2MoeMLP writes it: a routed expert,
    the shared expert, and the dense MLP of the layers that are not sparse."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class MoeBlock(SparseMoeBlock):
    """Qwen2-MoE's sparse block (Qwen2MoeSparseMoeBlock): the shared block, its softmax top-k router `gate`,
    Qwen2MoeMLP experts `experts.{e}` for the global expert ids this rank holds, and (built with
    shared_intermediate_size and shared_expert_gate) the shared expert `shared_experts` scaled by
    sigmoid(`shared_expert_gate`(x)), replicated on every rank."""

    expert_class = Expert


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the last dim's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with q/k/v biases (qkv_bias), no q/k norm and default RoPE, as Qwen2MoeAttention."""

    def __init__(self, cfg: Qwen2MoeConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.sliding_window = None  # use_sliding_window is refused by the config
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and rope (cos, sin [B, T, D]) -> q [B, heads, T, D], k and v [B, kv_heads, T, D], q and k
        rotated (apply_rotary_pos_emb's arithmetic)."""
        batch, seq, _ = x.shape
        # One matmul against [W_q; W_k; W_v] (the concatenation's backward hands each Parameter its rows).
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, weight, bias).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def decoder_layer(
    cfg: Qwen2MoeConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> DecoderLayer:
    """Qwen2MoeDecoderLayer: attention, then the sparse block (or, off the sparse layers, the dense MLP)."""
    attention = Attention(cfg, layer_idx)
    mlp: nn.Module
    if cfg.is_moe_layer(layer_idx):
        slots, ep_size = layer_share(cfg, placement, layer_idx)
        mlp = MoeBlock(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            slots,
            ep_rank,
            ep_size,
            router=RouterSettings(kind="softmax_topk"),
            shared_intermediate_size=cfg.shared_expert_intermediate_size,
            shared_expert_gate=True,
        )
    else:
        mlp = Expert(cfg.hidden_size, cfg.intermediate_size)  # Qwen2MoeMLP with intermediate_size
    norms = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return DecoderLayer(attention, mlp, *norms)


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Qwen2-MoE causal LM (steps/models/causal_lm.py). state_dict() keys are the family's module names; the
    state-dict adapter gives the checkpoint's (the shared expert's differ)."""

    config: Qwen2MoeConfig

    def __init__(self, config: Qwen2MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.config.head_dim is not None
        return rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
