"""gpt-oss's config: its hyper-parameters under the names config.json uses (transformers 5.23's GptOssConfig), read
from and written to config.json, and checked.

Refused here with one line naming the field and the fix: attention dropout, a rope type other than default or
yarn, layer_types other than "sliding_attention"/"full_attention", and quantized weights (the Hub's MXFP4
checkpoints, which import-sft dequantizes to bf16 before it reads them, mxfp4.py: the error names that and
transformers' dequantizing export, QUANTIZED_FIX; any other quantization: QUANTIZATION_FIX). transformers ignores
`hidden_act` (the experts' clamped SwiGLU is fixed), and so does moerl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models import config_checks as checks

MODEL_TYPE = "gpt_oss"
# The Hub's gpt-oss checkpoints store the experts as MXFP4 (*_blocks, *_scales); moerl reads float weights only,
# and its import dequantizes them (mxfp4.py).
QUANTIZED_FIX = (
    "moerl reads float weights; dequantize the MXFP4 experts: `python -m steps.import_sft --src DIR --run RUN` "
    "does it (to bf16), or with transformers: GptOssForCausalLM.from_pretrained(DIR, quantization_config="
    "Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(OUT_DIR), then use OUT_DIR"
)
QUANTIZATION_FIX = (
    "moerl reads float weights and dequantizes MXFP4 only; save the model unquantized in bf16 "
    "(model.to(torch.bfloat16).save_pretrained(OUT_DIR)), then use OUT_DIR"
)
ARCHITECTURE = "GptOssForCausalLM"
DEFAULT_ROPE_THETA = 150_000.0  # GptOssConfig.default_theta
LAYER_TYPES = ("sliding_attention", "full_attention")
# GptOssConfig's default rope_parameters (gpt-oss-20b/120b's): YaRN x32 over 4096 positions, untruncated ramp
DEFAULT_YARN: dict[str, Any] = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}  # fmt: skip
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings", "attention_factor",
             "mscale", "mscale_all_dim")  # fmt: skip


@dataclass
class GptOssConfig:
    """gpt-oss hyper-parameters, under the names config.json uses (GptOssConfig). Every decoder layer is sparse:
    num_local_experts clamped-SwiGLU experts of intermediate_size each, top num_experts_per_tok. layer_types
    gives each layer's attention: "sliding_attention" (the last sliding_window keys) or "full_attention"."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    head_dim: int | None = 64  # GptOssConfig's default; None -> hidden_size // num_attention_heads
    sliding_window: int | None = 128
    layer_types: list[str] | None = None  # None -> sliding, full, sliding, ... (GptOssConfig.__post_init__)
    rms_norm_eps: float = 1e-5
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = field(default_factory=lambda: dict(DEFAULT_YARN))  # None: default RoPE
    max_position_embeddings: int = 131072
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)]  # sliding first

    @property
    def num_experts(self) -> int:
        """The routed experts per layer (FamilyConfig's name; config.json's is num_local_experts)."""
        return self.num_local_experts

    def is_moe_layer(self, layer: int) -> bool:
        """Every gpt-oss decoder layer is sparse."""
        return 0 <= layer < self.num_hidden_layers

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to every earlier key)."""
        assert self.layer_types is not None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers (v5, and v4 readers of rope_scaling) loads as GptOssForCausalLM,
        for weights stored in `dtype`."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta, "rope_type": "yarn"}
        extra = {
            "rope_scaling": rope if self.rope_scaling is not None else None,  # v4 readers
            "rope_parameters": rope,  # v5 readers
        }
        return checks.hf_config_dict(self, ARCHITECTURE, MODEL_TYPE, dtype, extra)

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a gpt-oss this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"gpt-oss's model_type is {MODEL_TYPE!r}"
        if d.get("num_local_experts", d.get("num_experts")) == 0:
            return "no experts (num_local_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> GptOssConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), "gpt-oss", source)
        quantization = d.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            checks.refuse_quantized(d, source, QUANTIZED_FIX if method == "mxfp4" else QUANTIZATION_FIX)
        checks.refuse_attention_dropout(d, source)
        rope_theta, rope_scaling = _rope(d, source)

        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_experts_per_tok"]  # fmt: skip
        num_experts = d.get("num_local_experts", d.get("num_experts"))
        checks.require(d, required, "gpt-oss", source, ("num_local_experts",) if num_experts is None else ())

        kwargs = checks.known_fields(cls, d)
        kwargs["num_local_experts"] = num_experts
        if d.get("num_key_value_heads") is None:  # as GptOssConfig.__post_init__
            kwargs["num_key_value_heads"] = d["num_attention_heads"]
        if "head_dim" in d:  # null: implied by hidden_size // num_attention_heads; absent: GptOssConfig's 64
            kwargs["head_dim"] = d["head_dim"]
        if "sliding_window" in d:
            kwargs["sliding_window"] = d["sliding_window"]
        kwargs["rope_theta"], kwargs["rope_scaling"] = rope_theta, rope_scaling
        for name in checks.TOKEN_IDS:
            if name in d:
                kwargs[name] = d[name]
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""
        checks.check_positive_ints(
            self,
            ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "head_dim", "max_position_embeddings"),
            source,
        )  # fmt: skip
        checks.check_window(self, source)
        checks.check_top_k(self, "num_local_experts", source)
        checks.check_kv_groups(self, source)
        assert self.head_dim is not None
        checks.check_rotary_dim(self, "head_dim", source)
        types = self.layer_types
        if not isinstance(types, list) or len(types) != self.num_hidden_layers or not set(types) <= set(LAYER_TYPES):
            raise checks.invalid(
                source,
                f"layer_types = {types!r} must list {self.num_hidden_layers} of {list(LAYER_TYPES)} (one per layer)"
            )
        checks.check_positive_numbers(self, ("rms_norm_eps", "rope_theta", "swiglu_alpha", "swiglu_limit"), source)
        checks.check_booleans(self, ("tie_word_embeddings", "attention_bias"), source)
        checks.check_yarn_factor(self.rope_scaling, source)
        if self.rope_scaling is not None:
            original = self.rope_scaling.get("original_max_position_embeddings")
            if not checks.is_positive_int(original):
                raise checks.invalid(
                    source, f"rope_scaling.original_max_position_embeddings = {original!r} must be a positive integer"
                )


def _rope(d: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the YaRN parameters or None for default RoPE) of a config.json dict, as transformers v5 reads
    them: rope_parameters (v5), else rope_scaling + rope_theta (v4, gpt-oss's published configs), else
    GptOssConfig's default (YaRN x32, theta 150000)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    field_name = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    if rope is None:
        return float(d.get("rope_theta") or DEFAULT_ROPE_THETA), dict(DEFAULT_YARN)
    if not isinstance(rope, dict):
        raise MoerlError(f"{source}: {field_name} = {rope!r} is not supported by moerl (expected an object)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta") or d.get("rope_theta") or DEFAULT_ROPE_THETA)
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise MoerlError(
            f"{source}: {field_name}.rope_type {rope_type!r} is not supported by moerl (gpt-oss: default or yarn)"
        )
    yarn = {"rope_type": "yarn", **{k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}}
    if "factor" not in yarn or "original_max_position_embeddings" not in yarn:
        raise MoerlError(
            f"{source}: {field_name} is yarn without factor and original_max_position_embeddings; fix config.json"
        )
    return theta, yarn
