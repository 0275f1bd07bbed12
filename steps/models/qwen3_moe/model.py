"""Qwen3-MoE's layers in plain PyTorch, matching transformers' Qwen3MoeForCausalLM: its experts (Qwen3MoeMLP) and
sparse block, attention, decoder layer and causal LM. Module names are the checkpoint's tensor names, so the
state-dict adapter (state_dict_adapter.py) maps them one to one.

Read top to bottom: the experts and the MoE block (the shared SparseMoeBlock with this family's experts), attention
(the shared softmax_kv_cache kind with q/k RMSNorm), the decoder layer and the causal LM (the shared skeleton,
steps/models/causal_lm.py, with this family's parts; the rollout engine decodes with its own prefill and key/value
tree, steps/engines/torch_engine.py, reading the modules through decode.py). The config is config.py; the shared
components are in steps/models/ (causal_lm.py, moe.py, layers.py, kernels.py, placement.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import DecoderLayer, MoeCausalLM
from steps.models.experts import SwiGLUExpert
from steps.models.kernels import QKVHeads
from steps.models.layers import RMSNorm, rotary_cos_sin, softmax_attention
from steps.models.moe import SparseMoeBlock
from steps.models.placement import layer_share
from steps.models.qwen3_moe.config import MoeConfig

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Expert(SwiGLUExpert):
    """One SwiGLU feed-forward expert, down(silu(gate(x)) * up(x)), named as Qwen3MoeMLP writes it (also the dense
    MLP of the layers that are not sparse)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class MoeBlock(SparseMoeBlock):
    """Qwen3-MoE's sparse block (Qwen3MoeSparseMoeBlock): the shared block, its softmax top-k router `gate` and
    Qwen3MoeMLP experts `experts.{e}` for the global expert ids this rank holds."""

    expert_class = Expert


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (before RoPE), as Qwen3MoeAttention."""

    def __init__(self, cfg: MoeConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.sliding_window = None
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and rope (cos, sin) -> q [B, heads, T, D], k and v [B, kv_heads, T, D], q and k normed and
        rotated."""
        cos, sin = rope
        # One matmul against [W_q; W_k; W_v] (the concatenation's backward hands each Parameter its rows).
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
        return QKVHeads.apply(
            F.linear(x, weight, bias), self.q_norm.weight, self.k_norm.weight, cos, sin,
            self.num_heads, self.num_kv_heads, self.q_norm.eps,
        )  # fmt: skip

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def decoder_layer(
    cfg: MoeConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> DecoderLayer:
    """Qwen3MoeDecoderLayer: attention, then the sparse block (or, off the sparse layers, the dense MLP)."""
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
        )
    else:
        mlp = Expert(cfg.hidden_size, cfg.intermediate_size)  # Qwen3MoeMLP: the same SwiGLU block
    norms = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return DecoderLayer(attention, mlp, *norms)


class MoeForCausalLM(MoeCausalLM):
    """Qwen3-MoE causal LM (steps/models/causal_lm.py). state_dict() keys are the tensor names of a Hugging Face
    Qwen3-MoE checkpoint."""

    config: MoeConfig

    def __init__(self, config: MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.config.head_dim is not None
        return rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
