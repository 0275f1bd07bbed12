"""Mixtral's Hugging Face tensor names: the one place in moerl they are listed (torchtitan's StateDictAdapter).

A checkpoint is what Mixtral's published checkpoints on the Hub hold and what transformers 5.23's
`MixtralForCausalLM.save_pretrained` writes (it fuses the experts in memory, gate_up_proj [E, 2I, H] and down_proj
[E, H, I], and splits them back on save, transformers/conversion_mapping.py "mixtral"): per layer the router
`block_sparse_moe.gate.weight` and per expert `block_sparse_moe.experts.{e}.w1/w2/w3.weight` (w1 the gate, w3 the
up, w2 the down projection). model.py names its modules as the checkpoint names its tensors, so to_hf and from_hf
are the identity (the trainer's candidates, the engines' in-place updates and the expert moves between EP ranks
all read and write the model's state_dict names as checkpoint names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from steps.models.mixtral.config import MixtralConfig

if TYPE_CHECKING:
    from steps.models.family import FusedExperts
    from steps.models.placement import ExpertPlacement

EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down: BlockSparseExpert.projections' (and run_experts') order


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """An expert's projection -> weight shape."""
    return {"w1": (intermediate, hidden), "w3": (intermediate, hidden), "w2": (hidden, intermediate)}


class MixtralStateDictAdapter:
    """Mixtral checkpoint names (steps/models/family.py StateDictAdapter)."""

    def fused_experts(self, cfg: Any) -> list[FusedExperts]:
        """No fused tensor: the checkpoint holds one tensor per expert (steps/models/family.py FusedExperts)."""
        return []

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """Why checkpoint tensor `name` (outside expected_shapes) is skipped on import, or None (refused)."""
        return None  # Mixtral checkpoints hold nothing the model lacks

    def expected_shapes(
        self, cfg: MixtralConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds -> shape; with a placement, only the experts EP rank
        ep_rank holds."""
        assert cfg.head_dim is not None
        h, d = cfg.hidden_size, cfg.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * d, h)
            shapes[p + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * d, h)
            shapes[p + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * d, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * d)
            shapes[p + "block_sparse_moe.gate.weight"] = (cfg.num_local_experts, h)
            held = range(cfg.num_local_experts) if placement is None else placement.held(layer, ep_rank)
            for e in sorted(held):  # every layer is sparse: MoE layer l is decoder layer l
                shapes.update(self.expert_params(cfg, layer, e))
        shapes["model.norm.weight"] = (h,)
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes

    def expert_params(self, cfg: MixtralConfig, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of one routed expert's parameters; `moe_layer` counts the MoE layers (all of them)."""
        prefix = f"model.layers.{moe_layer}.block_sparse_moe.experts.{expert}."
        shapes = expert_shapes(cfg.hidden_size, cfg.intermediate_size)
        return [(f"{prefix}{proj}.weight", shapes[proj]) for proj in EXPERT_PROJECTIONS]

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state
