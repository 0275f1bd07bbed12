"""DeepSeek-V3.2's layers, matching transformers 5.23's DeepseekV32ForCausalLM: DeepSeek-V3's MoE block and dense
MLP (steps/models/deepseek_v3/model.py) after the shared indexed multi-head latent attention (steps/models/dsa.py:
the lightning indexer's selection applied in every layer, in training, over packed rows and shared prompts, and in
the torch engine's decode). Module names are the checkpoint's tensor names (the indexer's under
self_attn.indexer.), so the state-dict adapter maps them one to one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from steps.models.causal_lm import MoeCausalLM
from steps.models.deepseek_v3.model import Expert, MoeBlock
from steps.models.deepseek_v32.config import DeepseekV32Config
from steps.models.dsa import IndexedDecoderLayer, IndexedMlaAttention
from steps.models.layers import RMSNorm
from steps.models.mla import rotary_cos_sin
from steps.models.moe import RouterSettings
from steps.models.placement import layer_share

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


def decoder_layer(
    cfg: DeepseekV32Config, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> IndexedDecoderLayer:
    """DeepseekV32DecoderLayer: indexed attention, then the MoE block (or, in the first layers, the dense MLP)."""
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
    return IndexedDecoderLayer(IndexedMlaAttention(cfg, layer_idx), mlp, *norms)


class DeepseekV32ForCausalLM(MoeCausalLM):
    """DeepSeek-V3.2 causal LM (steps/models/causal_lm.py), without its multi-token-prediction layer; the
    indexers are frozen (steps/models/dsa.py), the routers' correction bias a buffer."""

    config: DeepseekV32Config

    def __init__(self, config: DeepseekV32Config, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def init_extra(self, module: nn.Module) -> None:
        """As DeepseekV32PreTrainedModel: the correction bias at zero; the indexer's LayerNorm at (1, 0)."""
        if isinstance(module, MoeBlock):
            module.gate.e_score_correction_bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(self.config, positions, dtype)
