"""Qwen3-Next's config: its hyper-parameters under the names config.json uses (transformers 5.23's Qwen3NextConfig),
read from and written to config.json, and checked. Defaults are Qwen3NextConfig's, for the fields a config.json may
leave out (so moerl builds the model transformers builds of the same file); the sizes that make the model are
required.

Layer kinds. layer_types names each decoder layer's token mixer, "linear_attention" (gated DeltaNet) or
"full_attention" (gated softmax attention); without it, every full_attention_interval-th layer is full attention
(transformers' rule, default 4). SGLang 0.5.17's Qwen3NextConfig derives the kinds from full_attention_interval alone
(configs/qwen3_next.py layers_block_type), so a layer_types that no interval describes would be served as another
model: it is refused, and to_hf_dict writes both.

Refused with one line naming the field: quantized weights (the FP8 release: use the bf16 one), another activation,
attention dropout, q/k/v/o biases (attention_bias: the release has none), RoPE other than the default, and a dense
model (num_experts 0). Multi-token prediction (the release's mtp.* tensors): dropped on import, as transformers does
(_keys_to_ignore_on_load_unexpected); moerl trains and publishes the model without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models import config_checks as checks
from steps.models.gated_hybrid import FULL, LINEAR, interval_layer_types

MODEL_TYPE = "qwen3_next"
ARCHITECTURE = "Qwen3NextForCausalLM"
DEFAULT_INTERVAL = 4  # Qwen3NextConfig's full_attention_interval default
DEFAULT_PARTIAL_ROTARY = 0.25  # Qwen3NextConfig's partial_rotary_factor default


@dataclass
class Qwen3NextConfig:
    """Qwen3-Next hyper-parameters, under the names config.json uses (Qwen3NextConfig)."""

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
    head_dim: int = 256  # the full-attention layers' (Qwen3NextConfig's default, not hidden // heads)
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY  # the rotated share of each full-attention head
    full_attention_interval: int = DEFAULT_INTERVAL
    layer_types: list[str] = field(default_factory=list)  # [] -> from full_attention_interval
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.mlp_only_layers, tuple):
            self.mlp_only_layers = list(self.mlp_only_layers)
        if not self.layer_types and isinstance(self.full_attention_interval, int) and self.full_attention_interval > 0:
            self.layer_types = interval_layer_types(self.num_hidden_layers, self.full_attention_interval)
        self.layer_types = list(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """The rotated dims of each full-attention head (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def is_moe_layer(self, layer: int) -> bool:
        """As Qwen3NextDecoderLayer: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers 5.23 (and SGLang 0.5.17, by full_attention_interval) load as the
        same Qwen3NextForCausalLM, for weights stored in `dtype`."""
        extra = {
            "attention_bias": False,
            "rope_scaling": None,  # v4 readers (SGLang) read rope_theta + partial_rotary_factor
            "rope_parameters": {
                "rope_theta": self.rope_theta,
                "rope_type": "default",
                "partial_rotary_factor": self.partial_rotary_factor,
            },  # fmt: skip
        }
        return checks.hf_config_dict(self, ARCHITECTURE, MODEL_TYPE, dtype, extra)

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a Qwen3-Next this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"Qwen3-Next's model_type is {MODEL_TYPE!r}"
        if d.get("num_experts") == 0:
            return "no experts (num_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> Qwen3NextConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), "Qwen3-Next", source)
        checks.refuse_quantized(
            d, source, "the FP8 Qwen3-Next release is block-quantized; use the bf16 release (or dequantize it) and "
            "drop quantization_config",
        )  # fmt: skip
        rope_parameters = checks.default_rope_parameters(d, source)
        checks.refuse_other_activation(d, source, "Qwen3-Next's experts and gated DeltaNet use silu")
        checks.refuse_attention_dropout(d, source)
        if d.get("attention_bias"):
            raise checks.unsupported(
                d, "attention_bias", "q/k/v/o biases are not implemented (the release has none); set it to false",
                source,
            )  # fmt: skip
        required = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        ]  # fmt: skip
        checks.require(d, required, "Qwen3-Next", source)

        kwargs = checks.known_fields(cls, d)
        kwargs["rope_theta"] = d.get("rope_theta") or rope_parameters.get("rope_theta") or 10000.0
        factors = {rope_parameters.get("partial_rotary_factor"), d.get("partial_rotary_factor")} - {None}
        if len(factors) > 1:
            raise MoerlError(
                f"{source}: partial_rotary_factor = {d.get('partial_rotary_factor')} but "
                f"rope_parameters.partial_rotary_factor = {rope_parameters.get('partial_rotary_factor')} is not "
                "supported by moerl (transformers reads the latter, SGLang the former); make them agree"
            )
        kwargs["partial_rotary_factor"] = factors.pop() if factors else DEFAULT_PARTIAL_ROTARY
        layer_types = d.get("layer_types")
        interval = d.get("full_attention_interval")
        if layer_types is not None:
            layers = d["num_hidden_layers"]
            if not isinstance(layer_types, list) or len(layer_types) != layers:
                raise checks.invalid(source, f"layer_types = {layer_types!r} must list one kind per layer ({layers})")
            if any(kind not in (LINEAR, FULL) for kind in layer_types):
                raise checks.unsupported(d, "layer_types", f"each layer is {LINEAR!r} or {FULL!r}", source)
            fits = [i for i in range(1, layers + 1) if interval_layer_types(layers, i) == layer_types]
            if interval is None and fits:
                interval = fits[0]
            if interval not in fits:
                raise checks.unsupported(
                    d, "layer_types", "SGLang 0.5.17 places the full-attention layers by full_attention_interval "
                    f"alone (every interval-th layer){'' if interval is None else f', here {interval}'}; use "
                    "layer_types that an interval describes", source,
                )  # fmt: skip
        kwargs["full_attention_interval"] = DEFAULT_INTERVAL if interval is None else interval
        kwargs.pop("layer_types", None)  # rebuilt from the interval (the same list, checked above)
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
             "head_dim", "decoder_sparse_step", "full_attention_interval", "linear_conv_kernel_dim",
             "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"),
            source,
        )  # fmt: skip
        checks.check_top_k(self, "num_experts", source)
        checks.check_kv_groups(self, source)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise checks.invalid(
                source, f"linear_num_value_heads = {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads = {self.linear_num_key_heads}",
            )  # fmt: skip
        factor = self.partial_rotary_factor
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise checks.invalid(source, f"partial_rotary_factor = {factor!r} must be a number in (0, 1]")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise checks.invalid(
                source, f"head_dim {self.head_dim} x partial_rotary_factor {factor} = {self.rotary_dim} rotated dims "
                "must be even and at least 2",
            )  # fmt: skip
        if self.layer_types != interval_layer_types(self.num_hidden_layers, self.full_attention_interval):
            raise checks.invalid(
                source, f"layer_types {self.layer_types} are not every {self.full_attention_interval}-th layer full "
                "attention (full_attention_interval)",
            )  # fmt: skip
        checks.check_layer_indices(self, "mlp_only_layers", source)
        dense = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense and (not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            raise checks.invalid(
                source,
                f"layers {dense} are dense (mlp_only_layers / decoder_sparse_step) but "
                f"intermediate_size = {self.intermediate_size!r}",
            )
        checks.check_positive_numbers(self, ("rms_norm_eps", "rope_theta"), source)
        checks.check_booleans(self, ("norm_topk_prob", "tie_word_embeddings"), source)
