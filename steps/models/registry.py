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
from steps.models.deepseek_v3.spec import DEEPSEEK_V3
from steps.models.deepseek_v4.spec import DEEPSEEK_V4
from steps.models.deepseek_v32.spec import DEEPSEEK_V32
from steps.models.family import ModelFamily
from steps.models.glm4_moe.spec import GLM4_MOE
from steps.models.glm_moe_dsa.spec import GLM_MOE_DSA
from steps.models.gpt_oss.spec import GPT_OSS
from steps.models.kimi_k25.spec import KIMI_K25
from steps.models.minimax_m2.spec import MINIMAX_M2
from steps.models.mixtral.spec import MIXTRAL
from steps.models.qwen2_moe.spec import QWEN2_MOE
from steps.models.qwen3_5_moe.spec import QWEN3_5_MOE
from steps.models.qwen3_moe.spec import QWEN3_MOE
from steps.models.qwen3_next.spec import QWEN3_NEXT

FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        QWEN3_MOE, QWEN2_MOE, GLM4_MOE, MIXTRAL, DEEPSEEK_V3, DEEPSEEK_V32, GPT_OSS, MINIMAX_M2, QWEN3_NEXT,
        QWEN3_5_MOE, GLM_MOE_DSA, KIMI_K25, DEEPSEEK_V4,
    )  # fmt: skip
}

# model_types a family loads beside its own: Kimi-K2 says "kimi_k2" with architectures DeepseekV3ForCausalLM.
ALIASES: dict[str, str] = {"kimi_k2": DEEPSEEK_V3.model_type}

# MoE families users bring that moerl recognises and refuses by name: model_type -> (name, the nearest supported
# family's model_type, what it has that moerl does not implement).
REFUSED: dict[str, tuple[str, str, str]] = {
    "deepseek_v2": ("DeepSeek-V2", "deepseek_v3", "its softmax router with greedy or group-limited greedy top-k is"
                    " not implemented"),
    "olmoe": ("OLMoE", "qwen3_moe", "its q/k norms over the whole projection are not implemented"),
    "qwen3_5_moe_text": ("Qwen3.5-MoE (text-only)", "qwen3_5_moe", "the text-only layout (Qwen3_5MoeForCausalLM) is"
                         " not read; use the released vision-language checkpoint"),
    "llama4": ("Llama-4", "qwen3_moe", "interleaved dense and MoE layers, chunked attention and its vision tower are"
               " not implemented"),
    "llama4_text": ("Llama-4", "qwen3_moe", "interleaved dense and MoE layers and chunked attention are not"
                    " implemented"),
}  # fmt: skip


def supported() -> str:
    """The supported families, as errors list them."""
    return "; ".join(family.description for family in FAMILIES.values())


def resolve(d: dict[str, Any], source: str = "config.json") -> ModelFamily:
    """The family of a config.json dict (`source` names it in errors), or one MoerlError line: a refused
    model_type names the nearest supported family, an unknown one lists the supported families."""
    model_type = d.get("model_type")
    family = FAMILIES.get(ALIASES.get(model_type, model_type)) if isinstance(model_type, str) else None
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
    for family in FAMILIES.values():  # the exact class first: a family's config may extend another's
        if type(cfg) is family.config:
            return family
    for family in FAMILIES.values():
        if isinstance(cfg, family.config):
            return family
    raise TypeError(f"{type(cfg).__name__} is no registered family's config (steps/models/registry.py)")
