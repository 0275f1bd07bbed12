"""Qwen3-Next's layers in plain PyTorch, matching transformers 5.23's Qwen3NextForCausalLM: the shared hybrid decoder
(steps/models/gated_hybrid.py: zero-centred norms, gated softmax attention, gated DeltaNet linear attention, the
decode) over Qwen3-Next's own DeltaNet projections, its experts and the MoE block with a sigmoid-gated shared expert.

Module names are the checkpoint's tensor names except one: the shared MoE block (steps/models/moe.py) names the
shared expert `shared_experts`, the checkpoint `shared_expert`; the state-dict adapter (state_dict_adapter.py) maps
the two. The linear-attention layers hold Qwen3-Next's own tensors (in_proj_qkvz and in_proj_ba, grouped per key
head: Qwen3NextGatedDeltaNet) and regroup the two projections into the shared GatedDeltaNet's fused one at each call
(a copy of the weights' rows: the arithmetic is GatedDeltaNet's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.experts import SwiGLUExpert
from steps.models.gated_deltanet import from_grouped_projections
from steps.models.gated_hybrid import CheckpointDeltaNet, HybridCausalLM, ZeroCentredRMSNorm, hybrid_layer
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share
from steps.models.qwen3_next.config import Qwen3NextConfig

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Expert(SwiGLUExpert):
    """One SwiGLU feed-forward block, down(silu(gate(x)) * up(x)), named as Qwen3NextMLP writes it: a routed expert,
    the shared expert, and the dense MLP of the layers that are not sparse."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class MoeBlock(SparseMoeBlock):
    """Qwen3NextSparseMoeBlock: the shared block, its softmax top-k router `gate`, experts `experts.{e}` for the
    global expert ids this rank holds, and the shared expert `shared_experts` scaled by
    sigmoid(`shared_expert_gate`(x)), replicated on every rank."""

    expert_class = Expert


class Qwen3NextGatedDeltaNet(CheckpointDeltaNet):
    """The shared GatedDeltaNet over Qwen3NextGatedDeltaNet's parameters: in_proj_qkvz [2*Hk*Dk + 2*Hv*Dv, H] and
    in_proj_ba [2*Hv, H], grouped per key head, regrouped into the fused projection at each call
    (from_grouped_projections); conv1d.weight, A_log, dt_bias, norm.weight, out_proj (CheckpointDeltaNet)."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__(cfg)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.num_value_heads, bias=False)

    def fused_projection(self) -> torch.Tensor:
        """GatedDeltaNet's fused input projection weight (rows q | k | v | z | b | a) from the grouped two."""
        return from_grouped_projections(
            self.in_proj_qkvz.weight, self.in_proj_ba.weight,
            self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim,
        )  # fmt: skip

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = self.num_value_heads
        return F.linear(x, self.fused_projection()).split([self.conv_dim, self.value_dim, heads, heads], dim=-1)


def decoder_layer(
    cfg: Qwen3NextConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> nn.Module:
    """Qwen3NextDecoderLayer: its token mixer by layer_types, then the sparse block (or, off the sparse layers, the
    dense MLP)."""
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
        mlp = Expert(cfg.hidden_size, cfg.intermediate_size)  # Qwen3NextMLP with intermediate_size
    return hybrid_layer(cfg, layer_idx, Qwen3NextGatedDeltaNet, mlp)


class Qwen3NextCausalLM(HybridCausalLM):
    """Qwen3-Next causal LM (steps/models/causal_lm.py), without the multi-token-prediction module (config.py).
    state_dict() keys are the family's module names; the state-dict adapter gives the checkpoint's."""

    config: Qwen3NextConfig

    def __init__(self, config: Qwen3NextConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps),
        )
