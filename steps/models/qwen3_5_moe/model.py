"""Qwen3.5-MoE's language model in plain PyTorch, matching transformers 5.23's Qwen3_5MoeForConditionalGeneration on
text: the shared hybrid decoder (steps/models/gated_hybrid.py) over Qwen3.5's own DeltaNet projections
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), routed experts that hold their [gate; up] projection as one tensor
(a slice of the checkpoint's fused experts.gate_up_proj), and the MoE block with a sigmoid-gated shared expert in
every layer; plus the vision tower, carried unchanged (steps/models/carried.py, its tensors: vision.py).

Module names: `model.` (embed_tokens, layers, norm) and `lm_head` for the language model, `visual.` for the tower,
`model.layers.N.mlp.experts.{e}.gate_up_proj` / `.down_proj` per routed expert, `mlp.shared_experts` for the shared
expert (the shared MoE block's name); the state-dict adapter maps them to the checkpoint's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from steps.models.carried import CarriedTensors
from steps.models.experts import SWIGLU, RoutedExpert, SwiGLUExpert
from steps.models.gated_hybrid import CheckpointDeltaNet, HybridCausalLM, ZeroCentredRMSNorm, hybrid_layer
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share
from steps.models.qwen3_5_moe.config import Qwen3_5MoeConfig
from steps.models.qwen3_5_moe.vision import vision_shapes

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class SharedExpert(SwiGLUExpert):
    """Qwen3_5MoeMLP, the shared expert: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class Expert(RoutedExpert):
    """One routed expert, expert e's slice of Qwen3_5MoeExperts: gate_up_proj [2I, H] (the gate's I rows, then the
    up projection's) and down_proj [H, I]; computed by the shared SwiGLU kind, which reads the gate and up rows as
    views of the one parameter (their gradients land in it)."""

    arithmetic = SWIGLU

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size))

    def expert_weights(self) -> list[torch.Tensor]:
        gate, up = self.gate_up_proj.split(self.intermediate_size)
        return [gate, up, self.down_proj]


class MoeBlock(SparseMoeBlock):
    """Qwen3_5MoeSparseMoeBlock: the softmax top-k router `gate` (top-k renormalised), routed experts
    `experts.{e}` for the global ids this rank holds, the shared expert scaled by sigmoid(shared_expert_gate(x))."""

    expert_class = Expert
    shared_expert_class = SharedExpert


class Qwen3_5MoeGatedDeltaNet(CheckpointDeltaNet):
    """The shared GatedDeltaNet over Qwen3_5MoeGatedDeltaNet's parameters: in_proj_qkv [2*Hk*Dk + Hv*Dv, H] (all q
    heads, all k heads, all v heads: the conv's input as it is), in_proj_z [Hv*Dv, H], in_proj_b and in_proj_a
    [Hv, H]; conv1d.weight, A_log, dt_bias, norm.weight, out_proj (CheckpointDeltaNet)."""

    def __init__(self, cfg: Qwen3_5MoeConfig) -> None:
        super().__init__(cfg)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.num_value_heads, bias=False)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)


def decoder_layer(
    cfg: Qwen3_5MoeConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> nn.Module:
    """Qwen3_5MoeDecoderLayer: its token mixer by layer_types, then the sparse block (every layer's)."""
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
    return hybrid_layer(cfg, layer_idx, Qwen3_5MoeGatedDeltaNet, mlp)


class Qwen3_5MoeCausalLM(HybridCausalLM):
    """Qwen3.5-MoE: the language model (steps/models/causal_lm.py) trained on text, and `visual`, the vision tower's
    tensors carried unchanged. state_dict() keys are the family's module names; the adapter gives the
    checkpoint's."""

    config: Qwen3_5MoeConfig

    def __init__(self, config: Qwen3_5MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps),
        )
        self.visual = CarriedTensors(vision_shapes(config.vision_config))

    def init_extra(self, module: nn.Module) -> None:
        """The hybrid decoder's rule, and the routed experts' two tensors normal(0, initializer_range)."""
        super().init_extra(module)
        if isinstance(module, Expert):
            module.gate_up_proj.normal_(0.0, self.config.initializer_range)
            module.down_proj.normal_(0.0, self.config.initializer_range)
