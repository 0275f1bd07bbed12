"""The checks every family's config.py makes of config.json in the same words: refusals of what moerl does not
implement (quantized weights, an activation other than silu, attention dropout, RoPE other than the default),
required fields, and the value checks of validate() (positive integers, numbers > 0, booleans, the heads' grouping,
top-k within the experts). Each raises MoerlError with one line naming `source`, the field and the fix; the
families' own checks (and every field's name) stay in their config.py. Also the frame of config.json that
to_hf_dict writes around a family's fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models.family import dtype_name

UNQUANTIZED_FIX = "use an unquantized F32/BF16/F16 checkpoint"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


# --- reading config.json (a dict `d`) ---------------------------------------------------------------------------


def unsupported(d: dict[str, Any], name: str, why: str, source: str) -> MoerlError:
    """`source: name = value is not supported by moerl (why)`."""
    return MoerlError(f"{source}: {name} = {d.get(name)!r} is not supported by moerl ({why})")


def refuse(refusal: tuple[str, str] | None, family: str, source: str) -> None:
    """Raise a config class's refusal (what, why) of a config.json dict, naming the family."""
    if refusal is not None:  # the registry (steps/models/registry.py) refuses these first, naming the families
        what, why = refusal
        raise MoerlError(f"{source}: {what}: not supported by the {family} config ({why})")


def refuse_quantized(d: dict[str, Any], source: str, why: str = UNQUANTIZED_FIX) -> None:
    if d.get("quantization_config"):
        raise unsupported(d, "quantization_config", why, source)


def refuse_other_activation(d: dict[str, Any], source: str, why: str) -> None:
    """hidden_act other than silu (absent: silu)."""
    if d.get("hidden_act", "silu") != "silu":
        raise unsupported(d, "hidden_act", why, source)


def refuse_attention_dropout(d: dict[str, Any], source: str) -> None:
    if d.get("attention_dropout", 0.0):
        raise unsupported(d, "attention_dropout", "set it to 0.0", source)


def rope_type(rope: object) -> str:
    """A rope_scaling / rope_parameters dict's type (v4 "type" or v5 "rope_type"; absent: default)."""
    if not isinstance(rope, dict):
        return repr(rope)
    return rope.get("rope_type", rope.get("type", "default"))


def default_rope_parameters(d: dict[str, Any], source: str) -> dict[str, Any]:
    """config.json's rope_parameters ({} when absent), after refusing RoPE other than the default in it or in
    rope_scaling."""
    rope_scaling = d.get("rope_scaling")
    if rope_scaling and rope_type(rope_scaling) != "default":
        raise unsupported(d, "rope_scaling", "only default RoPE; set it to null", source)
    rope_parameters = d.get("rope_parameters") or {}
    if rope_parameters and rope_type(rope_parameters) != "default":
        raise MoerlError(
            f"{source}: rope_parameters.rope_type {rope_type(rope_parameters)!r} is not supported "
            "by moerl (only default RoPE)"
        )
    return rope_parameters


def require(
    d: dict[str, Any], names: list[str], family: str, source: str, also_missing: tuple[str, ...] = ()
) -> None:
    """Refuse a config.json without (or with null) any of `names`, or missing the fields `also_missing` (which the
    family found missing by its own rule), naming them all."""
    missing = [name for name in names if d.get(name) is None] + list(also_missing)
    if missing:
        raise MoerlError(f"{source}: missing required {family} fields {missing}; fix config.json")


def known_fields(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The non-null entries of `d` that are fields of the dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names and v is not None}


# --- validate(): a built config's values ---------------------------------------------------------------------------


def invalid(source: str, msg: str) -> MoerlError:
    """`source: msg; fix config.json`."""
    return MoerlError(f"{source}: {msg}; fix config.json")


def is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_ints(cfg: object, names: list[str] | tuple[str, ...], source: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not is_positive_int(value):
            raise invalid(source, f"{name} = {value!r} must be a positive integer")


def check_positive_numbers(cfg: object, names: tuple[str, ...], source: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise invalid(source, f"{name} = {value!r} must be a number > 0")


def check_booleans(cfg: object, names: tuple[str, ...], source: str) -> None:
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise invalid(source, f"{name} = {getattr(cfg, name)!r} must be true or false")


def check_top_k(cfg: Any, experts_field: str, source: str) -> None:
    """num_experts_per_tok at most the routed experts (config.json's field `experts_field`)."""
    experts = getattr(cfg, experts_field)
    if cfg.num_experts_per_tok > experts:
        raise invalid(source, f"num_experts_per_tok = {cfg.num_experts_per_tok} exceeds {experts_field} = {experts}")


def check_kv_groups(cfg: Any, source: str) -> None:
    """Grouped-query attention: the query heads a multiple of the key/value heads."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise invalid(
            source,
            f"num_attention_heads = {cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads = {cfg.num_key_value_heads}",
        )


def check_rotary_dim(cfg: object, name: str, source: str) -> None:
    """The rotated dims (field `name`) even."""
    value = getattr(cfg, name)
    if value % 2:
        raise invalid(source, f"{name} = {value} must be even for rotary embeddings")


def check_layer_indices(cfg: Any, name: str, source: str) -> None:
    """The field `name` a list of layer indices, each in [0, num_hidden_layers)."""
    indices = getattr(cfg, name)
    if not isinstance(indices, list):
        raise invalid(source, f"{name} = {indices!r} must be a list of layer indices")
    layers = range(cfg.num_hidden_layers)
    bad_layers = [i for i in indices if not (isinstance(i, int) and i in layers)]
    if bad_layers:
        raise invalid(source, f"{name} {bad_layers} outside [0, num_hidden_layers={cfg.num_hidden_layers})")


def check_window(cfg: Any, source: str) -> None:
    """sliding_window null or a positive integer."""
    if cfg.sliding_window is not None and not is_positive_int(cfg.sliding_window):
        raise invalid(source, f"sliding_window = {cfg.sliding_window!r} must be null or a positive integer")


def check_yarn_factor(rope_scaling: dict[str, Any] | None, source: str) -> None:
    """YaRN's factor (when rope_scaling is set) a number >= 1."""
    if rope_scaling is not None:
        factor = rope_scaling.get("factor")
        if not isinstance(factor, int | float) or isinstance(factor, bool) or factor < 1:
            raise invalid(source, f"rope_scaling.factor = {factor!r} must be a number >= 1 for yarn")


# --- writing config.json ---------------------------------------------------------------------------------------------


def hf_config_dict(
    cfg: Any, architecture: str, model_type: str | None, dtype: torch.dtype, extra: dict[str, Any]
) -> dict[str, Any]:
    """config.json of a family's config dataclass `cfg`: architectures and model_type (None: cfg has it as a
    field), its fields, silu and no attention dropout, the family's `extra` entries, then what every family writes
    (the cache on, no router logits, and the dtype the weights are stored in: transformers' and SGLang's dtype auto
    serve the weights in it)."""
    name = dtype_name(dtype)
    d: dict[str, Any] = {"architectures": [architecture]}
    if model_type is not None:
        d["model_type"] = model_type
    d.update(dataclasses.asdict(cfg))
    d.update({"hidden_act": "silu", "attention_dropout": 0.0})
    d.update(extra)
    d.update({"use_cache": True, "output_router_logits": False, "dtype": name, "torch_dtype": name})
    return d
