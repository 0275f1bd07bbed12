"""DeepSeek-V3.2's Hugging Face tensor names: DeepSeek-V3's (steps/models/deepseek_v3/state_dict_adapter.py: per
expert, the multi-token-prediction layer model.layers.{num_hidden_layers} dropped on import) and each layer's
indexer: self_attn.indexer.wq_b.weight [index_n_heads * index_head_dim, q_lora_rank], self_attn.indexer.wk.weight
[index_head_dim, hidden_size], self_attn.indexer.k_norm.weight and .bias [index_head_dim],
self_attn.indexer.weights_proj.weight [index_n_heads, hidden_size] (moerl holds and writes it in float32, as
transformers holds it after loading, spec.py float32_tensors; a checkpoint may store it in the weights'
dtype). What transformers 5.23's save_pretrained writes (its conversion mapping
"deepseek_v32" -> "qwen2_moe" splits the in-memory fused experts back per expert) and SGLang 0.5.17 loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steps.models.deepseek_v3.state_dict_adapter import DeepseekV3StateDictAdapter
from steps.models.deepseek_v32.config import DeepseekV32Config
from steps.models.dsa import indexer_source

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


def indexer_shapes(cfg: DeepseekV32Config) -> dict[str, tuple[int, ...]]:
    """One layer's indexer tensors (names under self_attn.indexer.) -> shape."""
    assert cfg.q_lora_rank is not None
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    return {
        "wq_b.weight": (heads * dim, cfg.q_lora_rank), "wk.weight": (dim, cfg.hidden_size),
        "k_norm.weight": (dim,), "k_norm.bias": (dim,), "weights_proj.weight": (heads, cfg.hidden_size),
    }  # fmt: skip


class DeepseekV32StateDictAdapter(DeepseekV3StateDictAdapter):
    """DeepSeek-V3.2 checkpoint names (steps/models/family.py StateDictAdapter)."""

    def expected_shapes(
        self, cfg: DeepseekV32Config, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """DeepSeek-V3's tensors and the indexer of every layer that runs one (all, but GLM-5's shared layers)."""
        shapes = super().expected_shapes(cfg, placement, ep_rank)
        for layer in range(cfg.num_hidden_layers):
            if indexer_source(cfg, layer) != layer:
                continue  # GLM-5's shared layers have no indexer
            for name, shape in indexer_shapes(cfg).items():
                shapes[f"model.layers.{layer}.self_attn.indexer.{name}"] = shape
        return shapes
