"""GLM-4.5 / GLM-4.6's layers in plain PyTorch, matching transformers' Glm4MoeForCausalLM: its experts
(Glm4MoeMLP) and sparse block, attention, decoder layer and causal LM. Module names are the checkpoint's tensor
names, so the state-dict adapter (state_dict_adapter.py) maps them one to one.

Read top to bottom: the experts and the MoE block (the shared SparseMoeBlock with the router kind
"sigmoid_group_topk" and shared experts, steps/models/moe.py), attention (softmax over a key/value cache, with
q/k/v biases, optional q/k RMSNorm and partial rotary embedding), the decoder layer and the causal LM (the shared
skeleton, steps/models/causal_lm.py). The rollout engine decodes with its own prefill and key/value tree
(steps/engines/torch_engine.py), reading the modules through decode.py. The config is config.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import DecoderLayer, MoeCausalLM
from steps.models.experts import SwiGLUExpert
from steps.models.glm4_moe.config import Glm4MoeConfig
from steps.models.layers import RMSNorm, apply_partial_rotary, rotary_cos_sin, softmax_attention
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Expert(SwiGLUExpert):
    """One SwiGLU feed-forward block, down(silu(gate(x)) * up(x)), named as Glm4MoeMLP writes it: a routed expert,
    the shared experts (one block of n_shared_experts * moe_intermediate_size) and the dense layers' MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class MoeBlock(SparseMoeBlock):
    """GLM-4-MoE's sparse block (Glm4MoeMoE): the shared block with its sigmoid group-limited router `gate` (and
    its e_score_correction_bias buffer), the routed experts `experts.{e}` this rank holds and `shared_experts`."""

    expert_class = Expert


class Attention(nn.Module):
    """Grouped-query attention as Glm4MoeAttention: q/k/v biases when attention_bias (o_proj never has one),
    per-head RMSNorm of q and k before the rotation when use_qk_norm, rotary embedding over the first rotary_dim
    dims of each head."""

    def __init__(self, cfg: Glm4MoeConfig, layer_idx: int) -> None:
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
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and rope (cos, sin [B, T, rotary_dim]) -> q [B, heads, T, D], k and v [B, kv_heads, T, D],
        q and k normed (use_qk_norm) and rotated over their first rotary_dim dims."""
        batch, seq, _ = x.shape
        cos, sin = rope
        # One matmul against [W_q; W_k; W_v] (the concatenation's backward hands each Parameter its rows).
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, weight, bias).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_partial_rotary(q.transpose(1, 2), cos, sin)
        k = apply_partial_rotary(k.transpose(1, 2), cos, sin)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def decoder_layer(
    cfg: Glm4MoeConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> DecoderLayer:
    """Glm4MoeDecoderLayer: attention, then the sparse block (or, in the first first_k_dense_replace layers, the
    dense MLP)."""
    mlp: nn.Module
    if cfg.is_moe_layer(layer_idx):
        slots, ep_size = layer_share(cfg, placement, layer_idx)
        mlp = MoeBlock(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            slots,
            ep_rank,
            ep_size,
            router=RouterSettings(
                kind="sigmoid_group_topk",
                n_group=cfg.n_group,
                topk_group=cfg.topk_group,
                routed_scaling_factor=cfg.routed_scaling_factor,
            ),
            shared_intermediate_size=cfg.n_shared_experts * cfg.moe_intermediate_size,
        )
    else:
        mlp = Expert(cfg.hidden_size, cfg.intermediate_size)  # Glm4MoeMLP: the same SwiGLU block
    norms = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return DecoderLayer(Attention(cfg, layer_idx), mlp, *norms)


class Glm4MoeForCausalLM(MoeCausalLM):
    """GLM-4-MoE causal LM (steps/models/causal_lm.py). state_dict() keys are the tensor names of a Hugging Face
    GLM-4-MoE checkpoint (without multi-token-prediction layers, config.py)."""

    config: Glm4MoeConfig

    def __init__(self, config: Glm4MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rotary_dim]: default RoPE over the rotated dims (inv_freq = theta^(-2i/rotary_dim))."""
        return rotary_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, dtype)
