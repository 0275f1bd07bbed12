"""GLM-5's config (transformers 5.23's GlmMoeDsaConfig): DeepSeek-V3.2's fields and checks
(steps/models/deepseek_v32/config.py) with GlmMoeDsaConfig's defaults, and indexer_types: per layer "full" (the layer
runs its indexer) or "shared" (it reuses the selection of the last full layer before it). Without indexer_types,
transformers derives them from index_topk_pattern ("F"/"S" a layer), else index_topk_freq (default 1) and
index_skip_topk_offset (default 2): layer i is full when max(i - offset + 1, 0) % freq == 0; so does moerl, and
writes indexer_types back. The first layer must be full.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from steps.models import config_checks as checks
from steps.models.deepseek_v32.config import DeepseekV32Config

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"
FULL, SHARED = "full", "shared"


def derived_indexer_types(d: dict[str, Any], layers: int) -> list[str]:
    """GlmMoeDsaConfig.__post_init__'s indexer_types of a config.json dict without them."""
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": FULL, "S": SHARED}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(d.get("index_topk_freq", 1), 1)
    offset = d.get("index_skip_topk_offset", 2)
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(layers)]


@dataclass
class GlmMoeDsaConfig(DeepseekV32Config):
    """GLM-5 hyper-parameters: DeepSeek-V3.2's, with GlmMoeDsaConfig's defaults, and indexer_types."""

    q_lora_rank: int | None = 2048
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 202752
    index_n_heads: int = 32
    indexer_types: list[str] = field(default_factory=list)  # [] -> every layer full
    model_type: str = MODEL_TYPE
    family_name: ClassVar[str] = "GLM-5"
    architecture: ClassVar[str] = ARCHITECTURE

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.indexer_types and isinstance(self.num_hidden_layers, int):
            self.indexer_types = [FULL] * self.num_hidden_layers
        self.indexer_types = list(self.indexer_types)

    @property
    def indexer_rope_interleave(self) -> bool:
        """GlmMoeDsaIndexer rotates its rope dims in DeepSeek's interleaved layout (steps/models/dsa.py)."""
        return True

    def indexer_source(self, layer: int) -> int:
        """The layer whose indexer selects layer `layer`'s keys: itself when full, else the last full one before."""
        while self.indexer_types[layer] != FULL:
            layer -= 1
        return layer

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers 5.23 loads as GlmMoeDsaForCausalLM."""
        d = super().to_hf_dict(dtype)
        d["architectures"] = [ARCHITECTURE]
        return d

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a GLM-5 this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"GLM-5's model_type is {MODEL_TYPE!r}"
        if not d.get("n_routed_experts", d.get("num_local_experts", 256)):
            return "no experts (n_routed_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> GlmMoeDsaConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        layers = d.get("num_hidden_layers")
        if d.get("indexer_types") is None and isinstance(layers, int):
            d = {**d, "indexer_types": derived_indexer_types(d, layers)}
        cfg = super().from_hf_dict(d, source)
        assert isinstance(cfg, GlmMoeDsaConfig)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """DeepSeek-V3.2's checks and the indexer layers'."""
        super().validate(source)
        kinds = self.indexer_types
        if not isinstance(kinds, list) or len(kinds) != self.num_hidden_layers or set(kinds) - {FULL, SHARED}:
            raise checks.invalid(source, f"indexer_types {kinds!r} must name {FULL!r} or {SHARED!r} for each layer")
        if kinds[0] != FULL:
            raise checks.invalid(source, "indexer_types[0] is 'shared': the first layer has no earlier one to share")
