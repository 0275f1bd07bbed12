"""Qwen3-Next's Hugging Face tensor names: the one place in moerl they are written (torchtitan's StateDictAdapter).

A checkpoint is what the released Qwen3-Next-80B-A3B holds (bf16) and what transformers 5.23's
`Qwen3NextForCausalLM.save_pretrained` writes (transformers fuses the routed experts in memory and splits them back
on save, conversion_mapping.py "qwen3_next" -> "qwen2_moe"), per expert. Per layer:
  linear-attention layers  linear_attn.in_proj_qkvz.weight [2*Hk*Dk + 2*Hv*Dv, H] (grouped per key head),
                           linear_attn.in_proj_ba.weight [2*Hv, H], linear_attn.conv1d.weight [conv channels, 1, K],
                           linear_attn.A_log and linear_attn.dt_bias [Hv], linear_attn.norm.weight [Dv],
                           linear_attn.out_proj.weight [H, Hv*Dv]
  full-attention layers    self_attn.q_proj.weight [heads*2*D, H] (per head: query rows, then gate rows),
                           self_attn.{k,v}_proj.weight, self_attn.o_proj.weight, self_attn.{q,k}_norm.weight [D]
  MoE layers               mlp.gate.weight [E, H], mlp.experts.{e}.{gate,up,down}_proj.weight,
                           mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, H]
  dense layers             mlp.{gate,up,down}_proj.weight
  every layer              input_layernorm.weight, post_attention_layernorm.weight (zero-centred: 1 + w applied)
and model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied). The release's
multi-token-prediction module (mtp.*) is dropped on import.

model.py names its modules so but for the shared expert, which the shared MoE block (steps/models/moe.py) calls
`shared_experts` and the checkpoint `shared_expert`: to_hf and from_hf rename that one module and keep every other
name (the linear-attention layers hold the checkpoint's grouped in_proj_qkvz and in_proj_ba as they are).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from steps.models.family import MTP_DROPPED
from steps.models.placement import moe_layer_indices
from steps.models.qwen3_next.config import Qwen3NextConfig

if TYPE_CHECKING:
    from steps.models.family import FusedExperts
    from steps.models.placement import ExpertPlacement

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # Qwen3NextMLP's, in run_experts' order
SHARED_MODEL, SHARED_HF = ".mlp.shared_experts.", ".mlp.shared_expert."
MTP_PREFIX = "mtp."  # the release's multi-token-prediction module


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's projection -> weight shape."""
    return {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}


def _renamed(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {name.replace(old, new, 1): tensor for name, tensor in state.items()}


class Qwen3NextStateDictAdapter:
    """Qwen3-Next checkpoint names (steps/models/family.py StateDictAdapter)."""

    def fused_experts(self, cfg: Any) -> list[FusedExperts]:
        """No fused tensor: the checkpoint holds one tensor per expert (steps/models/family.py FusedExperts)."""
        return []

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """Why checkpoint tensor `name` (outside expected_shapes) is skipped on import, or None (refused)."""
        return MTP_DROPPED if name.startswith(MTP_PREFIX) else None

    def expected_shapes(
        self, cfg: Qwen3NextConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds -> shape; with a placement, only the experts EP rank
        ep_rank holds (the router, the shared expert and its gate are on every rank)."""
        h, d = cfg.hidden_size, cfg.head_dim
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_channels = 2 * hk * dk + hv * dv
        moe_layers = moe_layer_indices(cfg)
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if cfg.is_linear_attention(layer):
                shapes[p + "linear_attn.in_proj_qkvz.weight"] = (2 * hk * dk + 2 * hv * dv, h)
                shapes[p + "linear_attn.in_proj_ba.weight"] = (2 * hv, h)
                shapes[p + "linear_attn.conv1d.weight"] = (conv_channels, 1, cfg.linear_conv_kernel_dim)
                shapes[p + "linear_attn.A_log"] = (hv,)
                shapes[p + "linear_attn.dt_bias"] = (hv,)
                shapes[p + "linear_attn.norm.weight"] = (dv,)
                shapes[p + "linear_attn.out_proj.weight"] = (h, hv * dv)
            else:
                heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
                shapes[p + "self_attn.q_proj.weight"] = (heads * d * 2, h)
                shapes[p + "self_attn.k_proj.weight"] = (kv * d, h)
                shapes[p + "self_attn.v_proj.weight"] = (kv * d, h)
                shapes[p + "self_attn.o_proj.weight"] = (h, heads * d)
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            if cfg.is_moe_layer(layer):
                shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
                moe_layer = moe_layers.index(layer)
                held = range(cfg.num_experts) if placement is None else placement.held(moe_layer, ep_rank)
                for e in sorted(held):
                    shapes.update(self.expert_params(cfg, moe_layer, e))
                for proj, shape in expert_shapes(h, cfg.shared_expert_intermediate_size).items():
                    shapes[p + f"mlp.shared_expert.{proj}.weight"] = shape
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
            else:
                for proj, shape in expert_shapes(h, cfg.intermediate_size).items():
                    shapes[p + f"mlp.{proj}.weight"] = shape
        shapes["model.norm.weight"] = (h,)
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes

    def expert_params(self, cfg: Qwen3NextConfig, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of one routed expert's parameters; `moe_layer` counts the MoE layers."""
        prefix = f"model.layers.{moe_layer_indices(cfg)[moe_layer]}.mlp.experts.{expert}."
        shapes = expert_shapes(cfg.hidden_size, cfg.moe_intermediate_size)
        return [(f"{prefix}{proj}.weight", shapes[proj]) for proj in EXPERT_PROJECTIONS]

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model state_dict names -> checkpoint names: `mlp.shared_experts.` -> `mlp.shared_expert.`."""
        return _renamed(state, SHARED_MODEL, SHARED_HF)

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint names -> model state_dict names: `mlp.shared_expert.` -> `mlp.shared_experts.`."""
        return _renamed(state, SHARED_HF, SHARED_MODEL)
