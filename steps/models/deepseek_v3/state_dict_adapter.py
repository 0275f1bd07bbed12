"""DeepSeek-V3's Hugging Face tensor names: the one place in moerl they are written (torchtitan's StateDictAdapter).

A checkpoint is what transformers' `DeepseekV3ForCausalLM.save_pretrained` writes, with per-expert tensor names.
model.py names its modules as the checkpoint names its tensors, so to_hf and from_hf are the identity.

Multi-token-prediction layers (model.layers.{num_hidden_layers + i}.*, `is_mtp_tensor`) are not in the model:
they are never expected, loaded or written. The shared loader refuses a checkpoint that still holds them
(unexpected tensors); drop them from the checkpoint first.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from steps.models.deepseek_v3.config import DeepseekConfig
from steps.models.placement import moe_layer_indices

if TYPE_CHECKING:
    from steps.models.family import FusedExperts
    from steps.models.placement import ExpertPlacement

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # DeepseekV3MLP's, in run_experts' order
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's projection -> weight shape."""
    return {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}


def is_mtp_tensor(cfg: DeepseekConfig, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a multi-token-prediction layer (dropped by moerl)."""
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= cfg.num_hidden_layers


def attention_shapes(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's tensors (names under self_attn.) -> shape."""
    h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank is None:
        shapes["q_proj.weight"] = (heads * cfg.qk_head_dim, h)
    else:
        shapes["q_a_proj.weight"] = (cfg.q_lora_rank, h)
        if bias:
            shapes["q_a_proj.bias"] = (cfg.q_lora_rank,)
        shapes["q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes["q_b_proj.weight"] = (heads * cfg.qk_head_dim, cfg.q_lora_rank)
    shapes["kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
    if bias:
        shapes["kv_a_proj_with_mqa.bias"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
    shapes["kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes["kv_b_proj.weight"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    shapes["o_proj.weight"] = (h, heads * cfg.v_head_dim)
    if bias:
        shapes["o_proj.bias"] = (h,)
    return shapes


class DeepseekV3StateDictAdapter:
    """DeepSeek-V3 checkpoint names (steps/models/family.py StateDictAdapter)."""

    def fused_experts(self, cfg: Any) -> list[FusedExperts]:
        """No fused tensor: the checkpoint holds one tensor per expert (steps/models/family.py FusedExperts)."""
        return []

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """Why checkpoint tensor `name` (outside expected_shapes) is skipped on import, or None (refused)."""
        if not is_mtp_tensor(cfg, name):
            return None
        return "a multi-token-prediction layer: moerl trains and publishes the model without it"

    def expected_shapes(
        self, cfg: DeepseekConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds -> shape (no MTP layers); with a placement, only the
        routed experts EP rank ep_rank holds (the router, its correction bias and the shared experts on every
        rank)."""
        h = cfg.hidden_size
        moe_layers = moe_layer_indices(cfg)
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for name, shape in attention_shapes(cfg).items():
                shapes[p + "self_attn." + name] = shape
            if cfg.is_moe_layer(layer):
                shapes[p + "mlp.gate.weight"] = (cfg.n_routed_experts, h)
                shapes[p + "mlp.gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
                moe_layer = moe_layers.index(layer)
                held = range(cfg.n_routed_experts) if placement is None else placement.held(moe_layer, ep_rank)
                for e in sorted(held):
                    shapes.update(self.expert_params(cfg, moe_layer, e))
                shared = cfg.n_shared_experts * cfg.moe_intermediate_size
                for proj, shape in expert_shapes(h, shared).items():
                    shapes[p + f"mlp.shared_experts.{proj}.weight"] = shape
            else:
                for proj, shape in expert_shapes(h, cfg.intermediate_size).items():
                    shapes[p + f"mlp.{proj}.weight"] = shape
        shapes["model.norm.weight"] = (h,)
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes

    def expert_params(self, cfg: DeepseekConfig, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of one routed expert's parameters; `moe_layer` counts the MoE layers."""
        prefix = f"model.layers.{moe_layer_indices(cfg)[moe_layer]}.mlp.experts.{expert}."
        shapes = expert_shapes(cfg.hidden_size, cfg.moe_intermediate_size)
        return [(f"{prefix}{proj}.weight", shapes[proj]) for proj in EXPERT_PROJECTIONS]

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state
