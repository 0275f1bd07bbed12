"""DeepSeek-V3's layers in plain PyTorch, matching transformers' DeepseekV3ForCausalLM: multi-head latent
attention, the MoE block (sigmoid group-limited routing with a correction bias, plus shared experts), the dense
MLP of the first layers, and the causal LM. Module names are the checkpoint's tensor names, so the state-dict
adapter (state_dict_adapter.py) maps them one to one.

Read top to bottom: the experts and the MoE block (the shared SparseMoeBlock, router kind "sigmoid_group_topk"),
the decoder layer (multi-head latent attention, the shared steps/models/mla.py, through the causal LM's Attention
protocol: q and k of qk_nope + qk_rope dims per head, v of v_head_dim) and the causal LM (steps/models/causal_lm.py).
The torch engine reads the modules through decode.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from steps.models.causal_lm import DecoderLayer, MoeCausalLM
from steps.models.deepseek_v3.config import DeepseekConfig
from steps.models.experts import SwiGLUExpert
from steps.models.layers import RMSNorm
from steps.models.mla import MlaAttention, rotary_cos_sin
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Expert(SwiGLUExpert):
    """One SwiGLU feed-forward expert, down(silu(gate(x)) * up(x)), named as DeepseekV3MLP writes it (also the
    shared experts and the dense MLP of the first first_k_dense_replace layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class MoeBlock(SparseMoeBlock):
    """DeepseekV3MoE: the shared block with DeepseekV3TopkRouter's routing (`gate.weight` and the buffer
    `gate.e_score_correction_bias`, never trained), routed experts `experts.{e}` and `shared_experts`."""

    expert_class = Expert


def decoder_layer(
    cfg: DeepseekConfig,
    layer_idx: int,
    placement: ExpertPlacement | None = None,
    ep_rank: int = 0,
    layer_class: type[DecoderLayer] = DecoderLayer,
    attention_class: type[MlaAttention] = MlaAttention,
) -> DecoderLayer:
    """DeepseekV3DecoderLayer: attention, then the MoE block (or, in the first layers, the dense MLP); an extending
    family gives its own layer and attention classes (DeepSeek-V3.2's indexed ones)."""
    mlp: nn.Module
    if cfg.is_moe_layer(layer_idx):
        slots, ep_size = layer_share(cfg, placement, layer_idx)
        router = RouterSettings("sigmoid_group_topk", cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        mlp = MoeBlock(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.norm_topk_prob, slots, ep_rank, ep_size,
            router=router, shared_intermediate_size=cfg.n_shared_experts * cfg.moe_intermediate_size,
        )  # fmt: skip
    else:
        mlp = Expert(cfg.hidden_size, cfg.intermediate_size)
    norms = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return layer_class(attention_class(cfg, layer_idx), mlp, *norms)


class DeepseekV3ForCausalLM(MoeCausalLM):
    """DeepSeek-V3 causal LM (steps/models/causal_lm.py). state_dict() keys are the tensor names of a Hugging
    Face DeepSeek-V3 checkpoint without its multi-token-prediction layers; e_score_correction_bias is a buffer
    (in state_dict, never among the parameters the optimizer steps)."""

    config: DeepseekConfig
    layer_class: type[DecoderLayer] = DecoderLayer
    attention_class: type[MlaAttention] = MlaAttention

    def __init__(self, config: DeepseekConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank, self.layer_class, self.attention_class),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def init_extra(self, module: nn.Module) -> None:
        """As DeepseekV3PreTrainedModel: the correction bias starts at zero (init_weights' normal covers the
        router weight, a Linear here)."""
        if isinstance(module, MoeBlock):
            module.gate.e_score_correction_bias.zero_()

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(self.config, positions, dtype)
