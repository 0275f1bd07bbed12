"""MiniMax-M2's config: its hyper-parameters under the names config.json uses (transformers 5.23's MiniMaxM2Config),
read from and written to config.json, and checked.

What the released config.json says beyond transformers' fields, and what SGLang 0.5.17's MiniMaxM2ForCausalLM reads
with defaults that differ from the model transformers builds (models/minimax_m2.py): use_qk_norm (SGLang default
false; transformers always norms q and k over the whole projection), qk_norm_type "per_layer" (the only one),
scoring_func "sigmoid" (read with no default), use_routing_bias (SGLang default false; transformers always adds the
correction bias) and rotary_dim (SGLang default head_dim; transformers rotates rope_parameters.partial_rotary_factor
of each head). A config.json that leaves any of them out or says otherwise would be served by SGLang as another
model, so it is refused when read, and to_hf_dict writes them all.

Refused with one line naming the field: quantized weights (the release is FP8 block-quantized: convert it to bf16
first), another activation, attention dropout, router jitter, RoPE other than the default (with a partial rotary
factor), tied embeddings (SGLang always reads lm_head.weight), shared experts (shared_intermediate_size > 0: neither
transformers nor SGLang builds them), and attention kinds other than full softmax attention (attn_type_list).
Multi-token prediction (num_mtp_modules, tensors model.layers.{num_hidden_layers + i}.*): accepted and ignored, as
transformers and SGLang do; moerl trains and publishes the model without those layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models import config_checks as checks

MODEL_TYPE = "minimax_m2"
ARCHITECTURE = "MiniMaxM2ForCausalLM"
DEFAULT_ROPE_THETA = 5_000_000.0  # MiniMaxM2Config.default_theta
# What SGLang 0.5.17 must read in config.json to serve the model transformers builds (module docstring).
SERVED_AS_BUILT = {
    "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
}  # fmt: skip


@dataclass
class MiniMaxM2Config:
    """MiniMax-M2 hyper-parameters, under the names config.json uses. Every decoder layer is sparse: num_local_experts
    SwiGLU experts of intermediate_size each, chosen by sigmoid scores plus a selection-only correction bias, top
    num_experts_per_tok, renormalised; q and k RMS-normed over the whole projection; the first rotary_dim dims of
    each head rotated."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rotary_dim: int | None = None  # None -> head_dim
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    max_position_embeddings: int = 196608
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim

    @property
    def num_experts(self) -> int:
        """The routed experts per layer (FamilyConfig's name; config.json's is num_local_experts)."""
        return self.num_local_experts

    def is_moe_layer(self, layer: int) -> bool:
        """Every MiniMax-M2 decoder layer is sparse (MiniMaxM2DecoderLayer always builds MiniMaxM2SparseMoeBlock)."""
        return 0 <= layer < self.num_hidden_layers

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers 5.23 and SGLang 0.5.17 load as the same MiniMaxM2ForCausalLM, for
        weights stored in `dtype`."""
        assert self.head_dim is not None and self.rotary_dim is not None
        extra = {
            **SERVED_AS_BUILT,
            "router_jitter_noise": 0.0,
            "num_mtp_modules": 0,  # moerl's checkpoints hold no multi-token-prediction layer
            "rope_scaling": None,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default",
                                "partial_rotary_factor": self.rotary_dim / self.head_dim},  # fmt: skip
        }
        return checks.hf_config_dict(self, ARCHITECTURE, MODEL_TYPE, dtype, extra)

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a MiniMax-M2 this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"MiniMax-M2's model_type is {MODEL_TYPE!r}"
        if d.get("num_local_experts", d.get("num_experts")) == 0:
            return "no experts (num_local_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> MiniMaxM2Config:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), "MiniMax-M2", source)
        checks.refuse_quantized(
            d, source, "the released MiniMax-M2 weights are FP8 block-quantized; dequantize them to a bf16 checkpoint "
            "(weight x weight_scale_inv per 128 x 128 block) and drop quantization_config",
        )  # fmt: skip
        rope_parameters = checks.default_rope_parameters(d, source)
        checks.refuse_other_activation(d, source, "MiniMax-M2 experts use silu")
        checks.refuse_attention_dropout(d, source)
        if d.get("router_jitter_noise", 0.0):
            raise checks.unsupported(
                d, "router_jitter_noise", "router jitter is not implemented; set it to 0.0", source
            )
        for name, value in SERVED_AS_BUILT.items():
            if d.get(name) != value:
                raise checks.unsupported(
                    d, name, f"transformers' MiniMax-M2 always builds {name} = {value!r}, which SGLang 0.5.17 reads "
                    f"from config.json (models/minimax_m2.py); set {name}: {value!r}", source,
                )  # fmt: skip
        if d.get("shared_intermediate_size"):
            raise checks.unsupported(
                d, "shared_intermediate_size", "shared experts are built by neither transformers' nor SGLang's "
                "MiniMax-M2; set it to 0", source,
            )  # fmt: skip
        if any(kind != 1 for kind in d.get("attn_type_list") or []):
            raise checks.unsupported(
                d, "attn_type_list", "only full softmax attention (1) in every layer, as MiniMax-M2", source
            )
        checks.require(
            d, ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "num_experts_per_tok"], "MiniMax-M2", source,
            () if d.get("num_local_experts", d.get("num_experts")) is not None else ("num_local_experts",),
        )  # fmt: skip
        kwargs = checks.known_fields(cls, d)
        kwargs["num_local_experts"] = d.get("num_local_experts", d.get("num_experts"))
        kwargs["rope_theta"] = d.get("rope_theta") or rope_parameters.get("rope_theta") or DEFAULT_ROPE_THETA
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        factor = rope_parameters.get("partial_rotary_factor")
        rotary_dim = d.get("rotary_dim")
        if rotary_dim is None:
            # SGLang 0.5.17 reads rotary_dim only (default head_dim): a factor below 1 without it is served whole
            if factor not in (None, 1, 1.0):
                raise MoerlError(
                    f"{source}: rope_parameters.partial_rotary_factor = {factor} without rotary_dim is not supported "
                    "by moerl (SGLang 0.5.17's MiniMax-M2 reads rotary_dim, default head_dim); add rotary_dim: "
                    f"{int(head_dim * factor)}"
                )
        elif factor is not None and abs(rotary_dim - head_dim * factor) > 1e-6:
            raise MoerlError(
                f"{source}: rotary_dim = {rotary_dim} but rope_parameters.partial_rotary_factor = {factor} of head_dim "
                f"{head_dim} is {head_dim * factor} (transformers rotates by the factor, SGLang by rotary_dim); make "
                "them agree"
            )
        kwargs["rotary_dim"] = rotary_dim
        for name in checks.TOKEN_IDS:
            if name in d:
                kwargs[name] = d[name]
        cfg = cls(**kwargs)
        cfg.validate(source)
        if cfg.tie_word_embeddings:
            raise MoerlError(
                f"{source}: tie_word_embeddings = True is not supported by moerl (SGLang 0.5.17's MiniMax-M2 always "
                "reads its own lm_head.weight); save lm_head.weight as a copy of model.embed_tokens.weight and set it "
                "to false"
            )
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""
        checks.check_positive_ints(
            self,
            ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "head_dim", "max_position_embeddings"),
            source,
        )  # fmt: skip
        checks.check_top_k(self, "num_local_experts", source)
        checks.check_kv_groups(self, source)
        checks.check_rotary_dim(self, "head_dim", source)
        assert self.head_dim is not None and self.rotary_dim is not None
        if not 2 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise checks.invalid(
                source, f"rotary_dim = {self.rotary_dim} must be even, at least 2 and at most head_dim {self.head_dim}"
            )
        checks.check_positive_numbers(self, ("rms_norm_eps", "rope_theta"), source)
        checks.check_booleans(self, ("tie_word_embeddings",), source)
