"""Qwen2-MoE's config: its hyper-parameters under the names config.json uses (transformers' Qwen2MoeConfig), read
from and written to config.json, and checked. Defaults are Qwen2MoeConfig's, for the fields a config.json may
leave out; the sizes that make the model are required."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models.family import dtype_name

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
        name = dtype_name(dtype)
        d: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        d.update(dataclasses.asdict(self))
        d.update(
            {
                "hidden_act": "silu",
                "attention_dropout": 0.0,
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": self.num_hidden_layers,
                "layer_types": ["full_attention"] * self.num_hidden_layers,
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
        refusal = cls.refusal(d)
        if refusal is not None:  # the registry (steps/models/registry.py) refuses these first, naming the families
            what, why = refusal
            raise MoerlError(f"{source}: {what}: not supported by the Qwen2-MoE config ({why})")

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
        if d.get("use_sliding_window"):
            raise unsupported("use_sliding_window", "sliding-window attention is not implemented; set it to false")
        layer_types = d.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise unsupported("layer_types", "only full_attention layers; sliding-window attention is not implemented")
        if d.get("hidden_act", "silu") != "silu":
            raise unsupported("hidden_act", "Qwen2-MoE experts use silu")
        if d.get("attention_dropout", 0.0):
            raise unsupported("attention_dropout", "set it to 0.0")

        required = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        ]  # fmt: skip
        missing = [name for name in required if d.get(name) is None]
        if missing:
            raise MoerlError(f"{source}: missing required Qwen2-MoE fields {missing}; fix config.json")

        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        kwargs["rope_theta"] = d.get("rope_theta") or rope_parameters.get("rope_theta") or 10000.0
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs[name] = d.get(name)
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""

        def bad(msg: str) -> MoerlError:
            return MoerlError(f"{source}: {msg}; fix config.json")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "head_dim", "decoder_sparse_step"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(f"{name} = {value!r} must be a positive integer")
        if self.num_experts_per_tok > self.num_experts:
            raise bad(
                f"num_experts_per_tok = {self.num_experts_per_tok} exceeds num_experts = {self.num_experts}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                f"num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        assert self.head_dim is not None
        if self.head_dim % 2:
            raise bad(f"head_dim = {self.head_dim} must be even for rotary embeddings")
        if not isinstance(self.mlp_only_layers, list):
            raise bad(f"mlp_only_layers = {self.mlp_only_layers!r} must be a list of layer indices")
        layers = range(self.num_hidden_layers)
        bad_layers = [i for i in self.mlp_only_layers if not (isinstance(i, int) and i in layers)]
        if bad_layers:
            raise bad(f"mlp_only_layers {bad_layers} outside [0, num_hidden_layers={self.num_hidden_layers})")
        dense = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense and (not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            raise bad(
                f"layers {dense} are dense (mlp_only_layers / decoder_sparse_step) but "
                f"intermediate_size = {self.intermediate_size!r}"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise bad(f"{name} = {value!r} must be a number > 0")
        for name in ("norm_topk_prob", "tie_word_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} = {getattr(self, name)!r} must be true or false")


def _rope_type(rope: object) -> str:
    if not isinstance(rope, dict):
        return repr(rope)
    return rope.get("rope_type", rope.get("type", "default"))
