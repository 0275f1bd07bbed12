"""DeepSeek-V3.2's config (transformers 5.23's DeepseekV32Config): DeepSeek-V3's fields and checks
(steps/models/deepseek_v3/config.py) plus the lightning indexer's: index_n_heads, index_head_dim, index_topk.

transformers' DeepseekV32Attention always takes the query latent (q_lora_rank is required: the indexer reads it) and
always rotates the attention's rope dims in DeepSeek's interleaved layout (rope_interleave is no field of its
config); every layer is indexed (layer_types "indexed_attention"); the dense layers are the first
first_k_dense_replace (mlp_layer_types, when given, must say so). Refused otherwise, with the field named; the
release's FP8 weights (quantization_config) as DeepSeek-V3's are: dequantize to bf16 first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from steps.models import config_checks as checks
from steps.models.deepseek_v3.config import DeepseekConfig

MODEL_TYPE = "deepseek_v32"
ARCHITECTURE = "DeepseekV32ForCausalLM"
INDEXED = "indexed_attention"  # DeepseekV32Config's layer kind of every layer


@dataclass
class DeepseekV32Config(DeepseekConfig):
    """DeepSeek-V3.2 hyper-parameters: DeepseekConfig's and the indexer's (DeepseekV32Config's defaults)."""

    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    model_type: str = MODEL_TYPE
    family_name: ClassVar[str] = "DeepSeek-V3.2"
    architecture: ClassVar[str] = ARCHITECTURE

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers 5.23 and SGLang load as DeepseekV32ForCausalLM."""
        d = super().to_hf_dict(dtype)
        d["architectures"] = [ARCHITECTURE]
        d.pop("rope_interleave", None)  # not a DeepseekV32Config field: its attention always interleaves
        dense = min(self.first_k_dense_replace, self.num_hidden_layers)
        d["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (self.num_hidden_layers - dense)
        d["layer_types"] = [INDEXED] * self.num_hidden_layers
        return d

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a DeepSeek-V3.2 this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"DeepSeek-V3.2's model_type is {MODEL_TYPE!r}"
        if not d.get("n_routed_experts", d.get("num_local_experts", 256)):
            return "no experts (n_routed_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> DeepseekV32Config:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        if d.get("rope_interleave") is False:
            raise checks.unsupported(
                d, "rope_interleave", f"{cls.family_name}'s attention always rotates interleaved pairs; drop the field",
                source,
            )  # fmt: skip
        if "q_lora_rank" in d and d["q_lora_rank"] is None:
            raise checks.unsupported(d, "q_lora_rank", "the indexer reads the query latent: give its rank", source)
        layers = d.get("num_hidden_layers")
        layer_types = d.get("layer_types")
        if layer_types is not None and (not isinstance(layer_types, list) or set(layer_types) != {INDEXED}
                                        or len(layer_types) != layers):  # fmt: skip
            raise checks.unsupported(d, "layer_types", f"every {cls.family_name} layer is {INDEXED!r}", source)
        mlp_layer_types = d.get("mlp_layer_types")
        if mlp_layer_types is not None and isinstance(layers, int):
            dense = min(d.get("first_k_dense_replace", 3), layers)
            if list(mlp_layer_types) != ["dense"] * dense + ["sparse"] * (layers - dense):
                raise checks.unsupported(
                    d, "mlp_layer_types", f"moerl takes the first first_k_dense_replace ({dense}) layers dense and "
                    "the rest sparse", source,
                )  # fmt: skip
        cfg = super().from_hf_dict({k: v for k, v in d.items() if k != "rope_interleave"}, source)
        assert isinstance(cfg, DeepseekV32Config)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """DeepseekConfig's checks and the indexer's sizes."""
        super().validate(source)
        checks.check_positive_ints(self, ("index_n_heads", "index_head_dim", "index_topk"), source)
        if self.q_lora_rank is None:
            raise checks.invalid(source, "q_lora_rank = None: the indexer reads the query latent")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise checks.invalid(
                source, f"index_head_dim = {self.index_head_dim} is below qk_rope_head_dim = {self.qk_rope_head_dim} "
                "(the indexer rotates its first qk_rope_head_dim dims)",
            )  # fmt: skip
        if not self.rope_interleave:
            raise checks.invalid(source, f"rope_interleave = False: {self.family_name}'s attention always interleaves")
