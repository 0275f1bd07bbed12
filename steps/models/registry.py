"""The model families moerl supports, by config.json's `model_type`, and the ones it recognises and refuses.

    family = resolve(config_dict)          # a ModelFamily (steps/models/family.py), or one MoerlError line
    cfg = config_from_hf(config_dict)      # that family's validated config
    family_of(cfg).state_dict_adapter ...  # what the loader, the trainer and the engine ask

A family is a folder, steps/models/<model_type>/, whose spec.py builds its ModelFamily; FAMILIES lists them.
A refused `model_type` names the nearest supported family and what keeps it out; an unknown one lists the
supported families.
"""

from __future__ import annotations

from typing import Any

from steps.errors import MoerlError
from steps.models.family import ModelFamily
from steps.models.qwen3_moe.spec import QWEN3_MOE

FAMILIES: dict[str, ModelFamily] = {family.model_type: family for family in (QWEN3_MOE,)}

# MoE families users bring that moerl recognises and refuses by name: model_type -> (name, the nearest supported
# family's model_type, what it has that moerl does not implement).
REFUSED: dict[str, tuple[str, str, str]] = {
    "mixtral": ("Mixtral", "qwen3_moe", "its expert names and attention differ from Qwen3-MoE's"),
    "qwen2_moe": ("Qwen2-MoE", "qwen3_moe", "its shared expert with a sigmoid gate is not implemented"),
    "deepseek_v3": ("DeepSeek-V3", "qwen3_moe", "multi-head latent attention, shared experts and sigmoid routing"
                    " with a correction bias are not implemented"),
    "deepseek_v2": ("DeepSeek-V2", "qwen3_moe", "multi-head latent attention and shared experts are not implemented"),
    "olmoe": ("OLMoE", "qwen3_moe", "its q/k norms over the whole projection are not implemented"),
    "qwen3_next": ("Qwen3-Next", "qwen3_moe", "gated DeltaNet linear attention and a gated shared expert are not"
                   " implemented"),
    "gpt_oss": ("gpt-oss", "qwen3_moe", "attention sinks, sliding windows and biased clamped-SwiGLU experts are not"
                " implemented"),
    "glm4_moe": ("GLM-4-MoE", "qwen3_moe", "shared experts, sigmoid routing with a correction bias and partial"
                 " rotary embedding are not implemented"),
}  # fmt: skip


def supported() -> str:
    """The supported families, as errors list them."""
    return "; ".join(family.description for family in FAMILIES.values())


def resolve(d: dict[str, Any], source: str = "config.json") -> ModelFamily:
    """The family of a config.json dict (`source` names it in errors), or one MoerlError line: a refused
    model_type names the nearest supported family, an unknown one lists the supported families."""
    model_type = d.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is not None:
        refusal = family.config.refusal(d)  # a config of the family's model_type it still cannot take
        if refusal is None:
            return family
        what, why = refusal
    elif model_type in REFUSED:
        name, nearest, why = REFUSED[model_type]
        what = f"{name} (model_type {model_type!r}) is a MoE architecture"
        why = f"{why}; the nearest supported family is {FAMILIES[nearest].name} (model_type {nearest!r})"
    else:
        what, why = f"model_type {model_type!r}", "dense and other architectures are not implemented"
    raise MoerlError(
        f"{source}: {what}, architectures {d.get('architectures')}: not supported ({why}); moerl supports: "
        f"{supported()}"
    )


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Any:
    """The validated config of a config.json dict, built by its family's config class."""
    return resolve(d, source).config.from_hf_dict(d, source=source)


def family_of(cfg: Any) -> ModelFamily:
    """The family a config (or a model built from one: anything with a `config`) belongs to."""
    cfg = getattr(cfg, "config", cfg)
    for family in FAMILIES.values():
        if isinstance(cfg, family.config):
            return family
    raise TypeError(f"{type(cfg).__name__} is no registered family's config (steps/models/registry.py)")
