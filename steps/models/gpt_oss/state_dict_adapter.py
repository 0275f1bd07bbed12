"""gpt-oss's Hugging Face tensor names: the one place in moerl they are written (torchtitan's StateDictAdapter).

A checkpoint is what transformers 5.23's `GptOssForCausalLM.save_pretrained` writes (no conversion mapping: its
in-memory names), which is also what the Hub's unquantized gpt-oss checkpoints hold: per layer the router
`mlp.router.weight` [E, H] and `mlp.router.bias` [E], and the experts fused, one tensor per weight over all E
experts: `mlp.experts.gate_up_proj` [E, H, 2I] (gate columns even, up columns odd), `gate_up_proj_bias` [E, 2I],
`down_proj` [E, I, H], `down_proj_bias` [E, H]; attention with biases and `self_attn.sinks` [heads].

The model holds one module per expert (the shared MoE block's `experts.{e}`, so that an EP rank holds a subset
under global names) and calls its router `gate`: from_hf splits each fused tensor into its E experts' slices
(`mlp.experts.{e}.gate_up_proj` [H, 2I], ...) and renames the router; to_hf stacks the slices back, so it needs
every expert of a layer (a full model's state). fused_experts declares the fused tensors (FusedExperts: which
model slices feed each), so that an EP rank that holds some of the experts reads only its rows of them
(hf_checkpoint.load_pretrained) and the candidate writer gathers a fused tensor's slices from the EP ranks that
hold them (steps/training/candidate_writer.py). With a placement, expected_shapes still lists the whole fused
tensors (what the checkpoint holds), and expert_params names one expert's slices under the model's names (what
the trainer moves between EP ranks).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from steps.models.family import FusedExperts, split_fused_experts, stack_expert_slices
from steps.models.gpt_oss.config import GptOssConfig

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement

EXPERT_WEIGHTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # ClampedSwiGLU's order
ROUTER_MODEL, ROUTER_HF = ".mlp.gate.", ".mlp.router."
_EXPERT_SLICE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)$")  # model name of one expert's slice
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(" + "|".join(EXPERT_WEIGHTS) + r")$")  # checkpoint name of a fused one


def _router_to_hf(name: str) -> str:
    return name.replace(ROUTER_MODEL, ROUTER_HF, 1)


def _router_from_hf(name: str) -> str:
    return name.replace(ROUTER_HF, ROUTER_MODEL, 1)


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """One expert's weight -> shape (its slice of the fused tensors)."""
    return {"gate_up_proj": (hidden, 2 * intermediate), "gate_up_proj_bias": (2 * intermediate,),
            "down_proj": (intermediate, hidden), "down_proj_bias": (hidden,)}  # fmt: skip


class GptOssStateDictAdapter:
    """gpt-oss checkpoint names (steps/models/family.py StateDictAdapter)."""

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """Why checkpoint tensor `name` (outside expected_shapes) is skipped on import, or None (refused)."""
        return None  # unquantized gpt-oss checkpoints hold nothing the model lacks

    def fused_experts(self, cfg: GptOssConfig) -> list[FusedExperts]:
        """Every layer's four expert tensors, each the stack of its E experts' slices along dim 0."""
        e = cfg.num_local_experts
        shapes = expert_shapes(cfg.hidden_size, cfg.intermediate_size)
        return [
            FusedExperts(
                name=f"model.layers.{layer}.mlp.experts.{weight}",
                moe_layer=layer,  # every gpt-oss layer is a MoE layer
                experts=tuple(f"model.layers.{layer}.mlp.experts.{x}.{weight}" for x in range(e)),
                shape=(e, *shapes[weight]),
            )
            for layer in range(cfg.num_hidden_layers)
            for weight in EXPERT_WEIGHTS
        ]

    def expected_shapes(
        self, cfg: GptOssConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds -> shape. The experts of a layer are one tensor per
        weight, so a placement changes nothing: they are listed whole (an EP rank's rows of them:
        fused_experts)."""
        assert cfg.head_dim is not None
        h, d, e, inter = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts, cfg.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
            for proj, out_dim, in_dim in (("q", q_size, h), ("k", kv_size, h), ("v", kv_size, h), ("o", h, q_size)):
                shapes[p + f"self_attn.{proj}_proj.weight"] = (out_dim, in_dim)
                if cfg.attention_bias:
                    shapes[p + f"self_attn.{proj}_proj.bias"] = (out_dim,)
            shapes[p + "self_attn.sinks"] = (cfg.num_attention_heads,)
            shapes[p + "mlp.router.weight"] = (e, h)
            shapes[p + "mlp.router.bias"] = (e,)
            for name, shape in expert_shapes(h, inter).items():
                shapes[p + f"mlp.experts.{name}"] = (e, *shape)
        shapes["model.norm.weight"] = (h,)
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
        return shapes

    def expert_params(self, cfg: GptOssConfig, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(model name, shape) of one routed expert's slices; `moe_layer` counts the MoE layers (all of them)."""
        prefix = f"model.layers.{moe_layer}.mlp.experts.{expert}."
        shapes = expert_shapes(cfg.hidden_size, cfg.intermediate_size)
        return [(prefix + name, shapes[name]) for name in EXPERT_WEIGHTS]

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model state_dict names -> checkpoint names: the experts' slices stacked into the fused tensors (every
        expert 0..E-1 of a layer must be there), `mlp.gate.` -> `mlp.router.`."""
        return stack_expert_slices(state, _EXPERT_SLICE, _router_to_hf, "gpt-oss")

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint names -> model state_dict names: each fused expert tensor split into its experts' slices,
        `mlp.router.` -> `mlp.gate.`."""
        return split_fused_experts(state, _FUSED, _router_from_hf)
