"""MiniMax-M2's Hugging Face tensor names: the one place in moerl they are listed (torchtitan's StateDictAdapter).

A checkpoint is what the released MiniMax-M2 (in bf16) holds and what transformers 5.23's
`MiniMaxM2ForCausalLM.save_pretrained` writes (transformers/conversion_mapping.py "minimax_m2" -> "mixtral", plus
`block_sparse_moe.e_score_correction_bias` -> `mlp.e_score_correction_bias`): per layer the attention's
`self_attn.{q,k,v,o}_proj.weight` and `self_attn.{q,k}_norm.weight` ([heads x head_dim], [kv_heads x head_dim]), the
router `block_sparse_moe.gate.weight` and its `block_sparse_moe.e_score_correction_bias`, and per expert
`block_sparse_moe.experts.{e}.w1/w2/w3.weight` (w1 the gate, w3 the up, w2 the down projection). model.py names its
modules so, but for the correction bias, which the shared router holds as `gate.e_score_correction_bias`: to_hf and
from_hf rename that one tensor a layer. The multi-token-prediction layers of the release (model.layers.{L + i}.*,
num_mtp_modules) are dropped on import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from steps.models.family import MTP_DROPPED, beyond_the_last_layer
from steps.models.minimax_m2.config import MiniMaxM2Config

if TYPE_CHECKING:
    from steps.models.family import FusedExperts
    from steps.models.placement import ExpertPlacement

EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down: BlockSparseExpert.projections' (and run_experts') order
MODEL_BIAS = ".block_sparse_moe.gate.e_score_correction_bias"  # where the shared router holds it
CHECKPOINT_BIAS = ".block_sparse_moe.e_score_correction_bias"


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """An expert's projection -> weight shape."""
    return {"w1": (intermediate, hidden), "w3": (intermediate, hidden), "w2": (hidden, intermediate)}


class MiniMaxM2StateDictAdapter:
    """MiniMax-M2 checkpoint names (steps/models/family.py StateDictAdapter)."""

    def fused_experts(self, cfg: Any) -> list[FusedExperts]:
        """No fused tensor: the checkpoint holds one tensor per expert (steps/models/family.py FusedExperts)."""
        return []

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """Why checkpoint tensor `name` (outside expected_shapes) is skipped on import, or None (refused)."""
        return MTP_DROPPED if beyond_the_last_layer(cfg, name, "model.layers.") else None

    def expected_shapes(
        self, cfg: MiniMaxM2Config, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds -> shape; with a placement, only the experts EP rank
        ep_rank holds."""
        assert cfg.head_dim is not None
        h, d = cfg.hidden_size, cfg.head_dim
        q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q_size, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_size, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_size, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_size)
            shapes[p + "self_attn.q_norm.weight"] = (q_size,)
            shapes[p + "self_attn.k_norm.weight"] = (kv_size,)
            shapes[p + "block_sparse_moe.gate.weight"] = (cfg.num_local_experts, h)
            shapes[p + "block_sparse_moe.e_score_correction_bias"] = (cfg.num_local_experts,)
            held = range(cfg.num_local_experts) if placement is None else placement.held(layer, ep_rank)
            for e in sorted(held):  # every layer is sparse: MoE layer l is decoder layer l
                shapes.update(self.expert_params(cfg, layer, e))
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes

    def expert_params(self, cfg: MiniMaxM2Config, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of one routed expert's parameters; `moe_layer` counts the MoE layers (all of them)."""
        prefix = f"model.layers.{moe_layer}.block_sparse_moe.experts.{expert}."
        shapes = expert_shapes(cfg.hidden_size, cfg.intermediate_size)
        return [(f"{prefix}{proj}.weight", shapes[proj]) for proj in EXPERT_PROJECTIONS]

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_renamed(name, MODEL_BIAS, CHECKPOINT_BIAS): value for name, value in state.items()}

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_renamed(name, CHECKPOINT_BIAS, MODEL_BIAS): value for name, value in state.items()}


def _renamed(name: str, old: str, new: str) -> str:
    return name[: -len(old)] + new if name.endswith(old) else name
