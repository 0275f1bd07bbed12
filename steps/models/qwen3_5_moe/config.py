"""Qwen3.5-MoE's config: a vision-language config.json (transformers 5.23's Qwen3_5MoeConfig, model_type
"qwen3_5_moe", Qwen3_5MoeForConditionalGeneration) whose language model's hyper-parameters sit under `text_config`
(Qwen3_5MoeTextConfig) and whose vision tower's under `vision_config`. moerl trains the language model on text and
carries the vision tower through unchanged (steps/models/carried.py): the config keeps vision_config as given (its
sizes name the tower's tensors, vision.py) and the multimodal token ids, and writes them back.

The language model is Qwen3-Next's hybrid (steps/models/gated_hybrid.py) with every layer sparse (no dense MLP, no
mlp_only_layers or decoder_sparse_step: Qwen3_5MoeTextConfig deletes them) and the top-k router weights always
renormalised (Qwen3_5MoeTopKRouter). layer_types names each layer's token mixer; without it, every
full_attention_interval-th layer is full attention (default 4). RoPE is multimodal (mrope_section over the
rotated dims); a text token has one position on all three axes, so on text it is the default RoPE over
head_dim x partial_rotary_factor dims (the sections are kept and written back as given).

Refused with one line naming the field: quantized weights (the FP8 and NVFP4 releases: use the bf16 one), another
activation, attention dropout, q/k/v/o biases, RoPE other than the default, no experts, and a config.json without
text_config or vision_config (the text-only Qwen3_5MoeForCausalLM layout, model_type "qwen3_5_moe_text", is not
read). The release's multi-token-prediction tensors (mtp.*) are dropped on import, as transformers does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models import config_checks as checks
from steps.models.family import dtype_name
from steps.models.gated_hybrid import FULL, LINEAR, interval_layer_types

MODEL_TYPE = "qwen3_5_moe"
TEXT_MODEL_TYPE = "qwen3_5_moe_text"
VISION_MODEL_TYPE = "qwen3_5_moe_vision"
ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
DEFAULT_INTERVAL = 4
DEFAULT_PARTIAL_ROTARY = 0.25  # Qwen3_5MoeTextConfig's default
# Qwen3_5MoeConfig's top-level fields beside the two sub-configs, with its defaults
MULTIMODAL_TOKEN_IDS = {
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}  # fmt: skip


@dataclass
class Qwen3_5MoeConfig:
    """Qwen3.5-MoE hyper-parameters: the language model's under text_config's names, flat (the fields every family
    has are read from here), the vision tower's config and the multimodal token ids as config.json has them."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    vision_config: dict[str, Any] = field(default_factory=dict)  # as config.json has it (vision.py reads sizes)
    head_dim: int = 256
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY
    layer_types: list[str] = field(default_factory=list)  # [] -> every 4th layer full attention
    mrope_section: list[int] | None = None  # the multimodal RoPE's sections, written back as given
    mrope_interleaved: bool | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    image_token_id: int = MULTIMODAL_TOKEN_IDS["image_token_id"]
    video_token_id: int = MULTIMODAL_TOKEN_IDS["video_token_id"]
    vision_start_token_id: int = MULTIMODAL_TOKEN_IDS["vision_start_token_id"]
    vision_end_token_id: int = MULTIMODAL_TOKEN_IDS["vision_end_token_id"]
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types and isinstance(self.num_hidden_layers, int):
            self.layer_types = interval_layer_types(self.num_hidden_layers, DEFAULT_INTERVAL)
        self.layer_types = list(self.layer_types)

    @property
    def norm_topk_prob(self) -> bool:
        """Qwen3_5MoeTopKRouter always renormalises the top-k weights."""
        return True

    @property
    def rotary_dim(self) -> int:
        """The rotated dims of each full-attention head (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR

    def is_moe_layer(self, layer: int) -> bool:
        """Every Qwen3.5-MoE layer is sparse (Qwen3_5MoeDecoderLayer)."""
        return True

    def text_config(self) -> dict[str, Any]:
        """text_config as transformers 5.23 writes it (Qwen3_5MoeTextConfig.to_dict's fields)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor}  # fmt: skip
        if self.mrope_section is not None:
            rope["mrope_section"] = list(self.mrope_section)
        if self.mrope_interleaved is not None:
            rope["mrope_interleaved"] = self.mrope_interleaved
        names = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
            "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "rms_norm_eps",
            "max_position_embeddings", "tie_word_embeddings", "initializer_range", "router_aux_loss_coef",
            "bos_token_id", "eos_token_id", "pad_token_id",
        )  # fmt: skip
        text = {name: getattr(self, name) for name in names}
        text.update({"layer_types": list(self.layer_types), "rope_parameters": rope, "hidden_act": "silu",
                     "attention_bias": False, "attention_dropout": 0.0, "model_type": TEXT_MODEL_TYPE,
                     "partial_rotary_factor": self.partial_rotary_factor})  # fmt: skip
        interval = self.full_attention_interval()
        if interval is not None:  # what SGLang places the layers by (steps/engines/sglang_engine.py)
            text["full_attention_interval"] = interval
        return text

    def full_attention_interval(self) -> int | None:
        """The interval whose placement (every interval-th layer full attention) is layer_types, or None."""
        fits = [i for i in range(1, self.num_hidden_layers + 1)
                if interval_layer_types(self.num_hidden_layers, i) == self.layer_types]  # fmt: skip
        return fits[0] if fits else None

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers 5.23 loads as the same Qwen3_5MoeForConditionalGeneration, for
        weights stored in `dtype` (the vision tower's config as it was read)."""
        name = dtype_name(dtype)
        text = {**self.text_config(), "dtype": name}
        vision = {**copy.deepcopy(self.vision_config), "model_type": VISION_MODEL_TYPE}
        d: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text,
                             "vision_config": vision}  # fmt: skip
        d.update({key: getattr(self, key) for key in MULTIMODAL_TOKEN_IDS})
        d.update({"tie_word_embeddings": self.tie_word_embeddings, "dtype": name, "torch_dtype": name})
        return d

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a Qwen3.5-MoE this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"Qwen3.5-MoE's model_type is {MODEL_TYPE!r}"
        if not isinstance(d.get("text_config"), dict) or not isinstance(d.get("vision_config"), dict):
            return (
                "a config.json without text_config and vision_config objects",
                "moerl reads the released vision-language layout (Qwen3_5MoeForConditionalGeneration); save the "
                "model with Qwen3_5MoeForConditionalGeneration.save_pretrained",
            )
        if d["text_config"].get("num_experts") == 0:
            return "no experts (text_config.num_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> Qwen3_5MoeConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), "Qwen3.5-MoE", source)
        quantized_fix = (
            "the FP8 and NVFP4 Qwen3.5 releases are quantized; use the bf16 release (or dequantize it) and drop "
            "quantization_config"
        )
        checks.refuse_quantized(d, source, quantized_fix)
        text: dict[str, Any] = d["text_config"]
        where = f"{source} text_config"
        checks.refuse_quantized(text, where, quantized_fix)
        rope_parameters = checks.default_rope_parameters(text, where)
        checks.refuse_other_activation(text, where, "Qwen3.5-MoE's experts and gated DeltaNet use silu")
        checks.refuse_attention_dropout(text, where)
        if text.get("attention_bias"):
            raise checks.unsupported(
                text, "attention_bias", "q/k/v/o biases are not implemented (the release has none); set it to "
                "false", where,
            )  # fmt: skip
        required = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        ]  # fmt: skip
        checks.require(text, required, "Qwen3.5-MoE text_config", source)
        kwargs = checks.known_fields(cls, text)
        kwargs.pop("vision_config", None)
        kwargs["rope_theta"] = text.get("rope_theta") or rope_parameters.get("rope_theta") or 10000.0
        factors = {rope_parameters.get("partial_rotary_factor"), text.get("partial_rotary_factor")} - {None}
        if len(factors) > 1:
            raise MoerlError(
                f"{where}: partial_rotary_factor = {text.get('partial_rotary_factor')} but "
                f"rope_parameters.partial_rotary_factor = {rope_parameters.get('partial_rotary_factor')}; make them "
                "agree"
            )
        kwargs["partial_rotary_factor"] = factors.pop() if factors else DEFAULT_PARTIAL_ROTARY
        kwargs["mrope_section"] = rope_parameters.get("mrope_section")
        kwargs["mrope_interleaved"] = rope_parameters.get("mrope_interleaved")
        layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", DEFAULT_INTERVAL)
            if not checks.is_positive_int(interval):
                raise checks.invalid(where, f"full_attention_interval = {interval!r} must be a positive integer")
            layer_types = interval_layer_types(layers, interval) if isinstance(layers, int) else []
        elif not isinstance(layer_types, list) or len(layer_types) != layers:
            raise checks.invalid(where, f"layer_types = {layer_types!r} must list one kind per layer ({layers})")
        if any(kind not in (LINEAR, FULL) for kind in layer_types):
            raise checks.unsupported(text, "layer_types", f"each layer is {LINEAR!r} or {FULL!r}", where)
        kwargs["layer_types"] = list(layer_types)
        for name in checks.TOKEN_IDS:  # the language model's; a top-level id stands in for an absent one
            kwargs[name] = text.get(name, d.get(name))
        for name in MULTIMODAL_TOKEN_IDS:
            if d.get(name) is not None:
                kwargs[name] = d[name]
        # transformers and SGLang both tie by the top-level value (transformers' save_pretrained may write another
        # in text_config)
        kwargs["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        kwargs["vision_config"] = copy.deepcopy(d["vision_config"])
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""
        from steps.models.qwen3_5_moe.vision import check_vision_config  # the tower's sizes, beside its names

        where = f"{source} text_config"
        checks.check_positive_ints(
            self,
            ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
             "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
             "linear_num_key_heads", "linear_num_value_heads"),
            where,
        )  # fmt: skip
        checks.check_top_k(self, "num_experts", where)
        checks.check_kv_groups(self, where)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise checks.invalid(
                where, f"linear_num_value_heads = {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads = {self.linear_num_key_heads}",
            )  # fmt: skip
        factor = self.partial_rotary_factor
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise checks.invalid(where, f"partial_rotary_factor = {factor!r} must be a number in (0, 1]")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise checks.invalid(
                where, f"head_dim {self.head_dim} x partial_rotary_factor {factor} = {self.rotary_dim} rotated dims "
                "must be even and at least 2",
            )  # fmt: skip
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise checks.invalid(where, f"layer_types {self.layer_types} must name {LINEAR!r} or {FULL!r} per layer")
        checks.check_positive_numbers(self, ("rms_norm_eps", "rope_theta"), where)
        checks.check_booleans(self, ("tie_word_embeddings",), where)
        check_vision_config(self.vision_config, f"{source} vision_config")
