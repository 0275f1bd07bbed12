"""GLM-4.5 / GLM-4.6's Hugging Face tensor names: the one place in moerl they are written (torchtitan's
StateDictAdapter).

A checkpoint is what transformers' `Glm4MoeForCausalLM.save_pretrained` writes, with per-expert tensor names
(transformers fuses them in memory only: conversion_mapping.py maps glm4_moe like qwen2_moe), the router's
selection bias `mlp.gate.e_score_correction_bias` beside `mlp.gate.weight`, and no multi-token-prediction layers
(config.py). model.py names its modules as the checkpoint names its tensors, so to_hf and from_hf are the
identity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from steps.models.family import MTP_DROPPED, beyond_the_last_layer
from steps.models.glm4_moe.config import Glm4MoeConfig
from steps.models.placement import moe_layer_indices

if TYPE_CHECKING:
    from steps.models.family import FusedExperts
    from steps.models.placement import ExpertPlacement

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # Glm4MoeMLP's, in run_experts' order


def expert_prefix(cfg: Glm4MoeConfig, moe_layer: int, expert: int) -> str:
    return f"model.layers.{moe_layer_indices(cfg)[moe_layer]}.mlp.experts.{expert}."


def mlp_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's projection -> weight shape."""
    return {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}


class Glm4MoeStateDictAdapter:
    """GLM-4-MoE checkpoint names (steps/models/family.py StateDictAdapter)."""

    def fused_experts(self, cfg: Any) -> list[FusedExperts]:
        """No fused tensor: the checkpoint holds one tensor per expert (steps/models/family.py FusedExperts)."""
        return []

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """Why checkpoint tensor `name` (outside expected_shapes) is skipped on import, or None (refused)."""
        return MTP_DROPPED if beyond_the_last_layer(cfg, name, "model.layers.") else None

    def expected_shapes(
        self, cfg: Glm4MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds -> shape; with a placement, only the experts EP rank
        ep_rank holds."""
        assert cfg.head_dim is not None
        h, d = cfg.hidden_size, cfg.head_dim
        moe_layers = moe_layer_indices(cfg)
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for proj, out_dim in (("q", cfg.num_attention_heads * d), ("k", cfg.num_key_value_heads * d),
                                  ("v", cfg.num_key_value_heads * d)):  # fmt: skip
                shapes[p + f"self_attn.{proj}_proj.weight"] = (out_dim, h)
                if cfg.attention_bias:
                    shapes[p + f"self_attn.{proj}_proj.bias"] = (out_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * d)  # never a bias
            if cfg.use_qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            if cfg.is_moe_layer(layer):
                shapes[p + "mlp.gate.weight"] = (cfg.n_routed_experts, h)
                shapes[p + "mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
                moe_layer = moe_layers.index(layer)
                held = range(cfg.n_routed_experts) if placement is None else placement.held(moe_layer, ep_rank)
                for e in sorted(held):
                    shapes.update(self.expert_params(cfg, moe_layer, e))
                shared = mlp_shapes(h, cfg.n_shared_experts * cfg.moe_intermediate_size)
                for proj, shape in shared.items():
                    shapes[p + f"mlp.shared_experts.{proj}.weight"] = shape
            else:
                for proj, shape in mlp_shapes(h, cfg.intermediate_size).items():
                    shapes[p + f"mlp.{proj}.weight"] = shape
        shapes["model.norm.weight"] = (h,)
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes

    def expert_params(self, cfg: Glm4MoeConfig, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of one routed expert's parameters; `moe_layer` counts the MoE layers."""
        prefix = expert_prefix(cfg, moe_layer, expert)
        shapes = mlp_shapes(cfg.hidden_size, cfg.moe_intermediate_size)
        return [(f"{prefix}{proj}.weight", shapes[proj]) for proj in EXPERT_PROJECTIONS]

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state
