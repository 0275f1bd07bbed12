"""Kimi-K2.5's config: a vision-language config.json (KimiK25Config, model_type "kimi_k25") whose language model's
hyper-parameters are DeepSeek-V3's, under text_config (model_type deepseek_v3 or kimi_k2: read and checked as
steps/models/deepseek_v3/config.py does), and whose vision tower's sit under vision_config, kept as given (its sizes
name the carried tensors, vision.py). The top-level tie_word_embeddings decides, as in transformers' Kimi_K25Config
(default true), and the top-level token ids stand in for absent ones in text_config.

Refused with one line naming the field: the released checkpoint's INT4 experts (quantization_config, compressed-
tensors pack-quantized, at the top level or in text_config): moerl reads a bf16 conversion (decompress the experts to
bf16, e.g. with compressed-tensors' ModelCompressor.decompress, write them under the same names and drop
quantization_config); a config.json without text_config or vision_config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from steps.errors import MoerlError
from steps.models import config_checks as checks
from steps.models.deepseek_v3.config import MODEL_TYPES as TEXT_MODEL_TYPES
from steps.models.deepseek_v3.config import DeepseekConfig
from steps.models.family import dtype_name
from steps.models.kimi_k25.vision import check_vision_config, vision_sizes

MODEL_TYPE = "kimi_k25"
ARCHITECTURE = "KimiK25ForConditionalGeneration"
TEXT_ARCHITECTURE = "DeepseekV3ForCausalLM"
INT4_FIX = (
    "the Kimi-K2.5 release's routed experts are INT4 (compressed-tensors pack-quantized): decompress them to bf16 "
    "(compressed-tensors' ModelCompressor.decompress), save them under the same names and drop quantization_config"
)


@dataclass
class _LanguageModelConfig(DeepseekConfig):
    """text_config read as DeepSeek-V3's, its errors naming Kimi-K2.5."""

    family_name: ClassVar[str] = "Kimi-K2.5"


@dataclass
class KimiK25Config(DeepseekConfig):
    """Kimi-K2.5: the language model's DeepSeek-V3 hyper-parameters (DeepseekConfig's fields, flat), the vision
    tower's config as config.json has it, and the projector's width."""

    vision_config: dict[str, Any] = field(default_factory=dict)
    projection_hidden_size: int = 1152  # the projector's pre_norm width (the release: vision_config.mm_hidden_size)
    tie_word_embeddings: bool = True  # Kimi_K25Config's default
    model_type: str = MODEL_TYPE
    family_name: ClassVar[str] = "Kimi-K2.5"
    architecture: ClassVar[str] = ARCHITECTURE

    def text_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """text_config as DeepSeek-V3's config.json (DeepseekConfig.to_hf_dict's)."""
        names = {f.name for f in fields(DeepseekConfig)}
        text = DeepseekConfig(**{n: getattr(self, n) for n in names if n != "model_type"})
        return text.to_hf_dict(dtype)

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers 5.23 loads as the same Kimi_K25ForConditionalGeneration."""
        name = dtype_name(dtype)
        d: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
                             "text_config": self.text_config(dtype), "vision_config": copy.deepcopy(self.vision_config),
                             "projection_hidden_size": self.projection_hidden_size}  # fmt: skip
        for key in checks.TOKEN_IDS:
            d[key] = getattr(self, key)
        d.update({"tie_word_embeddings": self.tie_word_embeddings, "dtype": name, "torch_dtype": name})
        return d

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a Kimi-K2.5 this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"Kimi-K2.5's model_type is {MODEL_TYPE!r}"
        if not isinstance(d.get("text_config"), dict) or not isinstance(d.get("vision_config"), dict):
            return (
                "a config.json without text_config and vision_config objects",
                "Kimi-K2.5 is read in its released vision-language layout (KimiK25ForConditionalGeneration)",
            )
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> KimiK25Config:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), cls.family_name, source)
        checks.refuse_quantized(d, source, INT4_FIX)
        text = d["text_config"]
        checks.refuse_quantized(text, f"{source} text_config", INT4_FIX)
        if text.get("model_type", "deepseek_v3") not in TEXT_MODEL_TYPES:
            raise checks.unsupported(
                text, "model_type", f"Kimi-K2.5's language model is DeepSeek-V3's ({list(TEXT_MODEL_TYPES)})",
                f"{source} text_config",
            )  # fmt: skip
        ids = {key: d[key] for key in checks.TOKEN_IDS if key in d and key not in text}
        language = _LanguageModelConfig.from_hf_dict(
            {**text, "model_type": "deepseek_v3", **ids}, f"{source} text_config"
        )
        kwargs = {f.name: getattr(language, f.name) for f in fields(DeepseekConfig) if f.name != "model_type"}
        kwargs["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", True))
        vision = d["vision_config"]
        projection = d.get("projection_hidden_size") or vision.get("mm_hidden_size") or vision_sizes(vision)["hidden"]
        cfg = cls(**kwargs, vision_config=copy.deepcopy(vision), projection_hidden_size=projection)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """DeepseekConfig's checks of the language model and the tower's sizes."""
        super().validate(f"{source} text_config")
        check_vision_config(self.vision_config, f"{source} vision_config")
        if not checks.is_positive_int(self.projection_hidden_size):
            raise MoerlError(f"{source}: projection_hidden_size = {self.projection_hidden_size!r} must be a positive "
                             "integer; fix config.json")  # fmt: skip
