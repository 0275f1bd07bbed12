"""Mixtral's config: its hyper-parameters under the names config.json uses (transformers' MixtralConfig), read from
and written to config.json, and checked.

What moerl does not implement is refused here with one line naming the field and the fix: quantized weights, RoPE
other than the default, an activation other than silu, attention dropout, router jitter noise, and a sliding window
that could bind (neither the torch engine's decoder nor SGLang 0.5.17's MixtralForCausalLM applies one; see
MixtralConfig.window_can_bind). Two variants transformers runs but SGLang 0.5.17 would serve wrongly are refused
when config.json is read: a head_dim other than hidden_size // num_attention_heads and tied embeddings. (A config
built in code may have all three: the model then matches transformers, and the torch engine refuses the window.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models import config_checks as checks

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
DEFAULT_ROPE_THETA = 1_000_000.0  # MixtralConfig.default_theta: what transformers uses when config.json gives none


@dataclass
class MixtralConfig:
    """Mixtral hyper-parameters, under the names config.json uses (MixtralConfig). Every decoder layer is sparse:
    num_local_experts SwiGLU experts of intermediate_size each, top num_experts_per_tok, renormalised."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's (Mixtral has no dense MLP)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_local_experts: int
    num_experts_per_tok: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads, as transformers does
    rms_norm_eps: float = 1e-5
    rope_theta: float = DEFAULT_ROPE_THETA
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = None  # keys a query sees (itself and window - 1 before it); None: all
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def num_experts(self) -> int:
        """The routed experts per layer (FamilyConfig's name; config.json's is num_local_experts)."""
        return self.num_local_experts

    def is_moe_layer(self, layer: int) -> bool:
        """Every Mixtral decoder layer is sparse (MixtralDecoderLayer always builds MixtralSparseMoeBlock)."""
        return 0 <= layer < self.num_hidden_layers

    def window_can_bind(self) -> bool:
        """Whether the sliding window can hide a key from a query: a key at position k is seen from position q
        when k > q - sliding_window (transformers' sliding_window_overlay), so a window of at least
        max_position_embeddings never hides one."""
        return self.sliding_window is not None and self.sliding_window < self.max_position_embeddings

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers (v4 and v5) and SGLang load as MixtralForCausalLM, for weights
        stored in `dtype` (SGLang's and transformers' dtype auto serve the weights in it)."""
        extra = {
            "router_jitter_noise": 0.0,
            "rope_scaling": None,  # v4 readers (SGLang) read rope_theta + rope_scaling
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},  # v5 readers
        }
        return checks.hf_config_dict(self, ARCHITECTURE, MODEL_TYPE, dtype, extra)

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a Mixtral this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"Mixtral's model_type is {MODEL_TYPE!r}"
        if d.get("num_local_experts", d.get("num_experts")) == 0:
            return "no experts (num_local_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> MixtralConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), "Mixtral", source)
        checks.refuse_quantized(d, source)
        rope_parameters = checks.default_rope_parameters(d, source)
        checks.refuse_other_activation(d, source, "Mixtral experts use silu")
        checks.refuse_attention_dropout(d, source)
        if d.get("router_jitter_noise", 0.0):
            raise checks.unsupported(
                d, "router_jitter_noise", "router jitter is not implemented; set it to 0.0", source
            )

        required = [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_experts_per_tok",
        ]  # fmt: skip
        also_missing: list[str] = []
        if "num_key_value_heads" not in d:  # null is allowed: it means num_attention_heads
            also_missing.append("num_key_value_heads")
        num_experts = d.get("num_local_experts", d.get("num_experts"))  # transformers maps num_experts to it
        if num_experts is None:
            also_missing.append("num_local_experts")
        checks.require(d, required, "Mixtral", source, tuple(also_missing))

        kwargs = checks.known_fields(cls, d)
        kwargs["num_local_experts"] = num_experts
        if d["num_key_value_heads"] is None:  # as MixtralConfig.__post_init__
            kwargs["num_key_value_heads"] = d["num_attention_heads"]
        kwargs["rope_theta"] = d.get("rope_theta") or rope_parameters.get("rope_theta") or DEFAULT_ROPE_THETA
        kwargs["sliding_window"] = d.get("sliding_window")
        for name in checks.TOKEN_IDS:
            if name in d:  # absent: transformers' defaults (bos 1, eos 2, no pad), the dataclass's
                kwargs[name] = d[name]
        cfg = cls(**kwargs)
        cfg.validate(source)
        implied_head_dim = cfg.hidden_size // cfg.num_attention_heads
        if cfg.head_dim != implied_head_dim:
            raise MoerlError(
                f"{source}: head_dim = {cfg.head_dim} is not supported by moerl (SGLang 0.5.17's MixtralForCausalLM, "
                f"models/mixtral.py:149, uses hidden_size // num_attention_heads = {implied_head_dim})"
            )
        if cfg.tie_word_embeddings:
            raise MoerlError(
                f"{source}: tie_word_embeddings = True is not supported by moerl (SGLang 0.5.17's MixtralForCausalLM, "
                "models/mixtral.py:353, always reads its own lm_head.weight); save lm_head.weight as a copy of "
                "model.embed_tokens.weight and set it to false"
            )
        if cfg.window_can_bind():
            raise MoerlError(
                f"{source}: sliding_window = {cfg.sliding_window} is not supported by moerl (neither the torch "
                "engine's decoder nor SGLang 0.5.17's MixtralForCausalLM applies a window, and one shorter than "
                f"max_position_embeddings = {cfg.max_position_embeddings} could bind); set it to null, as "
                "Mixtral-8x7B/8x22B's configs do, if the model was not trained with a window"
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
        checks.check_window(self, source)
        checks.check_top_k(self, "num_local_experts", source)
        checks.check_kv_groups(self, source)
        assert self.head_dim is not None
        checks.check_rotary_dim(self, "head_dim", source)
        checks.check_positive_numbers(self, ("rms_norm_eps", "rope_theta"), source)
        checks.check_booleans(self, ("tie_word_embeddings",), source)
