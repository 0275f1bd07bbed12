"""Qwen2-MoE's config: its hyper-parameters under the names config.json uses (transformers' Qwen2MoeConfig), read
from and written to config.json, and checked. Defaults are Qwen2MoeConfig's, for the fields a config.json may
leave out; the sizes that make the model are required."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from steps.models import config_checks as checks

MODEL_TYPE = "qwen2_moe"
ARCHITECTURE = "Qwen2MoeForCausalLM"


@dataclass
class Qwen2MoeConfig:
    """Qwen2-MoE hyper-parameters, under the names config.json uses (Qwen2MoeConfig)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # the shared expert every token goes through, gated by a sigmoid
    intermediate_size: int = 5632  # the dense MLP of layers that are not sparse (mlp_only_layers, the sparse step)
    head_dim: int | None = None  # not a Qwen2MoeConfig field, read if present; None -> hidden // heads
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = True  # q/k/v projections' biases (o_proj has none)
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.mlp_only_layers, tuple):
            self.mlp_only_layers = list(self.mlp_only_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """As Qwen2MoeDecoderLayer: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers (v4 and v5) and SGLang load as Qwen2MoeForCausalLM, for weights
        stored in `dtype` (SGLang's and transformers' dtype auto serve the weights in it)."""
        extra = {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "rope_scaling": None,  # v4 readers (SGLang) read rope_theta + rope_scaling
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},  # v5 readers
        }
        return checks.hf_config_dict(self, ARCHITECTURE, MODEL_TYPE, dtype, extra)

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a Qwen2-MoE this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"Qwen2-MoE's model_type is {MODEL_TYPE!r}"
        if not d.get("num_experts"):
            return "no experts (num_experts 0)", "a dense Qwen2 has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> Qwen2MoeConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), "Qwen2-MoE", source)
        checks.refuse_quantized(d, source)
        rope_parameters = checks.default_rope_parameters(d, source)
        if d.get("use_sliding_window"):
            raise checks.unsupported(
                d, "use_sliding_window", "sliding-window attention is not implemented; set it to false", source
            )
        layer_types = d.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise checks.unsupported(
                d, "layer_types", "only full_attention layers; sliding-window attention is not implemented", source
            )
        checks.refuse_other_activation(d, source, "Qwen2-MoE experts use silu")
        checks.refuse_attention_dropout(d, source)

        required = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        ]  # fmt: skip
        checks.require(d, required, "Qwen2-MoE", source)

        kwargs = checks.known_fields(cls, d)
        kwargs["rope_theta"] = d.get("rope_theta") or rope_parameters.get("rope_theta") or 10000.0
        for name in checks.TOKEN_IDS:
            kwargs[name] = d.get(name)
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""
        checks.check_positive_ints(
            self,
            ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
             "head_dim", "decoder_sparse_step"),
            source,
        )  # fmt: skip
        checks.check_top_k(self, "num_experts", source)
        checks.check_kv_groups(self, source)
        assert self.head_dim is not None
        checks.check_rotary_dim(self, "head_dim", source)
        checks.check_layer_indices(self, "mlp_only_layers", source)
        dense = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense and (not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            raise checks.invalid(
                source,
                f"layers {dense} are dense (mlp_only_layers / decoder_sparse_step) but "
                f"intermediate_size = {self.intermediate_size!r}"
            )
        checks.check_positive_numbers(self, ("rms_norm_eps", "rope_theta"), source)
        checks.check_booleans(self, ("norm_topk_prob", "tie_word_embeddings", "qkv_bias"), source)
