"""Qwen3.5-MoE's Hugging Face tensor names: the one place in moerl they are written (torchtitan's StateDictAdapter).

A checkpoint is what the released Qwen3.5 MoE checkpoints hold (bf16) and what transformers 5.23's
`Qwen3_5MoeForConditionalGeneration.save_pretrained` writes (no conversion mapping for model_type qwen3_5_moe: its
in-memory names). The language model under `model.language_model.`:
  linear-attention layers  linear_attn.in_proj_qkv.weight [2*Hk*Dk + Hv*Dv, H], linear_attn.in_proj_z.weight
                           [Hv*Dv, H], linear_attn.in_proj_b.weight and in_proj_a.weight [Hv, H],
                           linear_attn.conv1d.weight [conv channels, 1, K], linear_attn.A_log and dt_bias [Hv],
                           linear_attn.norm.weight [Dv], linear_attn.out_proj.weight [H, Hv*Dv]
  full-attention layers    self_attn.q_proj.weight [heads*2*D, H] (per head: query rows, then gate rows),
                           self_attn.{k,v}_proj.weight, self_attn.o_proj.weight, self_attn.{q,k}_norm.weight [D]
  every layer (all MoE)    mlp.gate.weight [E, H], the routed experts fused: mlp.experts.gate_up_proj [E, 2I, H]
                           (per expert the gate's rows, then the up projection's) and mlp.experts.down_proj
                           [E, H, I], mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight
                           [1, H], input_layernorm.weight, post_attention_layernorm.weight
and embed_tokens.weight, norm.weight; `lm_head.weight` (absent when tied); the vision tower under `model.visual.`
(vision.py), carried unchanged. The release's multi-token-prediction module (mtp.*) is dropped on import.

The model (model.py) holds one module per routed expert (so that an EP rank holds a subset under global names):
from_hf splits each fused tensor into its experts' slices, to_hf stacks them back (it needs every expert of a
layer: a full model's state); fused_experts declares them, so that an EP rank reads only its rows and the candidate
writer gathers a fused tensor from the EP ranks that hold its experts. Other renames: `model.` <->
`model.language_model.`, `visual.` <-> `model.visual.`, `mlp.shared_experts.` <-> `mlp.shared_expert.`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from steps.models.family import MTP_DROPPED, FusedExperts, split_fused_experts, stack_expert_slices
from steps.models.qwen3_5_moe.config import Qwen3_5MoeConfig
from steps.models.qwen3_5_moe.vision import vision_shapes

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # a routed expert's tensors, in its slices' order
SHARED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LANGUAGE_MODEL, VISUAL, MODEL = "model.language_model.", "model.visual.", "model."
TOWER = "visual."  # the model's name of the carried vision tower
SHARED_MODEL, SHARED_HF = ".mlp.shared_experts.", ".mlp.shared_expert."
MTP_PREFIX = "mtp."
_EXPERT_SLICE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)$")  # model name of one expert's slice
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(" + "|".join(EXPERT_WEIGHTS) + r")$")  # checkpoint name of a fused one


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """One routed expert's tensors -> shape (its slices of the fused tensors)."""
    return {"gate_up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}


def vision_tower(cfg: Qwen3_5MoeConfig) -> dict[str, tuple[int, ...]]:
    """The vision tower's checkpoint tensors -> shape: what the family carries through unchanged."""
    return {VISUAL + name: shape for name, shape in vision_shapes(cfg.vision_config).items()}


def _to_hf_name(name: str) -> str:
    if name.startswith(TOWER):
        return VISUAL + name.removeprefix(TOWER)
    if name.startswith(MODEL):
        name = LANGUAGE_MODEL + name.removeprefix(MODEL)
    return name.replace(SHARED_MODEL, SHARED_HF, 1)


def _from_hf_name(name: str) -> str:
    if name.startswith(VISUAL):
        return TOWER + name.removeprefix(VISUAL)
    if name.startswith(LANGUAGE_MODEL):
        name = MODEL + name.removeprefix(LANGUAGE_MODEL)
    return name.replace(SHARED_HF, SHARED_MODEL, 1)


class Qwen3_5MoeStateDictAdapter:
    """Qwen3.5-MoE checkpoint names (steps/models/family.py StateDictAdapter)."""

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """Why checkpoint tensor `name` (outside expected_shapes) is skipped on import, or None (refused)."""
        return MTP_DROPPED if name.startswith(MTP_PREFIX) else None

    def fused_experts(self, cfg: Qwen3_5MoeConfig) -> list[FusedExperts]:
        """Every layer's two expert tensors, each the stack of its E experts' slices along dim 0 (every layer is
        a MoE layer, so the layer index is the MoE layer's)."""
        e = cfg.num_experts
        shapes = expert_shapes(cfg.hidden_size, cfg.moe_intermediate_size)
        return [
            FusedExperts(
                name=f"{LANGUAGE_MODEL}layers.{layer}.mlp.experts.{weight}",
                moe_layer=layer,
                experts=tuple(f"{MODEL}layers.{layer}.mlp.experts.{x}.{weight}" for x in range(e)),
                shape=(e, *shapes[weight]),
            )
            for layer in range(cfg.num_hidden_layers)
            for weight in EXPERT_WEIGHTS
        ]

    def expected_shapes(
        self, cfg: Qwen3_5MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds -> shape. The routed experts of a layer are one tensor
        per weight, so a placement changes nothing: they are listed whole (an EP rank's rows: fused_experts)."""
        h, d = cfg.hidden_size, cfg.head_dim
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_channels = 2 * hk * dk + hv * dv
        lm = LANGUAGE_MODEL
        shapes: dict[str, tuple[int, ...]] = {f"{lm}embed_tokens.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.num_hidden_layers):
            p = f"{lm}layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if cfg.is_linear_attention(layer):
                shapes[p + "linear_attn.in_proj_qkv.weight"] = (conv_channels, h)
                shapes[p + "linear_attn.in_proj_z.weight"] = (hv * dv, h)
                shapes[p + "linear_attn.in_proj_b.weight"] = (hv, h)
                shapes[p + "linear_attn.in_proj_a.weight"] = (hv, h)
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
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            for name, shape in expert_shapes(h, cfg.moe_intermediate_size).items():
                shapes[p + f"mlp.experts.{name}"] = (cfg.num_experts, *shape)
            inter = cfg.shared_expert_intermediate_size
            shared = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
            for proj in SHARED_PROJECTIONS:
                shapes[p + f"mlp.shared_expert.{proj}.weight"] = shared[proj]
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        shapes[f"{lm}norm.weight"] = (h,)
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        shapes.update(vision_tower(cfg))
        return shapes

    def expert_params(self, cfg: Qwen3_5MoeConfig, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(model name, shape) of one routed expert's slices; `moe_layer` counts the MoE layers (all of them)."""
        prefix = f"{MODEL}layers.{moe_layer}.mlp.experts.{expert}."
        shapes = expert_shapes(cfg.hidden_size, cfg.moe_intermediate_size)
        return [(prefix + name, shapes[name]) for name in EXPERT_WEIGHTS]

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model state_dict names -> checkpoint names: the experts' slices stacked into the fused tensors (every
        expert 0..E-1 of a layer must be there), the prefixes and the shared expert renamed."""
        return stack_expert_slices(state, _EXPERT_SLICE, _to_hf_name, "Qwen3.5-MoE")

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint names -> model state_dict names: each fused expert tensor split into its experts' slices, the
        prefixes and the shared expert renamed."""
        return split_fused_experts(state, _FUSED, _from_hf_name)
