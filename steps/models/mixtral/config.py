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

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models.family import dtype_name

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
        name = dtype_name(dtype)
        d: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        d.update(dataclasses.asdict(self))
        d.update(
            {
                "hidden_act": "silu",
                "attention_dropout": 0.0,
                "router_jitter_noise": 0.0,
                "rope_scaling": None,  # v4 readers (SGLang) read rope_theta + rope_scaling
                "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},  # v5 readers
                "use_cache": True,
                "output_router_logits": False,
                "dtype": name,
                "torch_dtype": name,
            }
        )
        return d

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
        refusal = cls.refusal(d)
        if refusal is not None:  # the registry (steps/models/registry.py) refuses these first, naming the families
            what, why = refusal
            raise MoerlError(f"{source}: {what}: not supported by the Mixtral config ({why})")

        def unsupported(name: str, why: str) -> MoerlError:
            return MoerlError(f"{source}: {name} = {d.get(name)!r} is not supported by moerl ({why})")

        if d.get("quantization_config"):
            raise unsupported("quantization_config", "use an unquantized F32/BF16/F16 checkpoint")
        rope_scaling = d.get("rope_scaling")
        if rope_scaling and _rope_type(rope_scaling) != "default":
            raise unsupported("rope_scaling", "only default RoPE; set it to null")
        rope_parameters = d.get("rope_parameters") or {}
        if rope_parameters and _rope_type(rope_parameters) != "default":
            raise MoerlError(
                f"{source}: rope_parameters.rope_type {_rope_type(rope_parameters)!r} is not supported "
                "by moerl (only default RoPE)"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise unsupported("hidden_act", "Mixtral experts use silu")
        if d.get("attention_dropout", 0.0):
            raise unsupported("attention_dropout", "set it to 0.0")
        if d.get("router_jitter_noise", 0.0):
            raise unsupported("router_jitter_noise", "router jitter is not implemented; set it to 0.0")

        required = [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_experts_per_tok",
        ]  # fmt: skip
        missing = [name for name in required if d.get(name) is None]
        if "num_key_value_heads" not in d:  # null is allowed: it means num_attention_heads
            missing.append("num_key_value_heads")
        num_experts = d.get("num_local_experts", d.get("num_experts"))  # transformers maps num_experts to it
        if num_experts is None:
            missing.append("num_local_experts")
        if missing:
            raise MoerlError(f"{source}: missing required Mixtral fields {missing}; fix config.json")

        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        kwargs["num_local_experts"] = num_experts
        if d["num_key_value_heads"] is None:  # as MixtralConfig.__post_init__
            kwargs["num_key_value_heads"] = d["num_attention_heads"]
        kwargs["rope_theta"] = d.get("rope_theta") or rope_parameters.get("rope_theta") or DEFAULT_ROPE_THETA
        kwargs["sliding_window"] = d.get("sliding_window")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
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

        def bad(msg: str) -> MoerlError:
            return MoerlError(f"{source}: {msg}; fix config.json")

        def positive_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "num_local_experts", "num_experts_per_tok", "head_dim",
                     "max_position_embeddings"):  # fmt: skip
            if not positive_int(getattr(self, name)):
                raise bad(f"{name} = {getattr(self, name)!r} must be a positive integer")
        if self.sliding_window is not None and not positive_int(self.sliding_window):
            raise bad(f"sliding_window = {self.sliding_window!r} must be null or a positive integer")
        if self.num_experts_per_tok > self.num_local_experts:
            raise bad(
                f"num_experts_per_tok = {self.num_experts_per_tok} exceeds num_local_experts = "
                f"{self.num_local_experts}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                f"num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        assert self.head_dim is not None
        if self.head_dim % 2:
            raise bad(f"head_dim = {self.head_dim} must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise bad(f"{name} = {value!r} must be a number > 0")
        if not isinstance(self.tie_word_embeddings, bool):
            raise bad(f"tie_word_embeddings = {self.tie_word_embeddings!r} must be true or false")


def _rope_type(rope: object) -> str:
    if not isinstance(rope, dict):
        return repr(rope)
    return rope.get("rope_type", rope.get("type", "default"))
