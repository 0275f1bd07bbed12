"""GLM-5's model: DeepSeek-V3.2's (steps/models/deepseek_v32/model.py), whose indexed attention reads the config's
indexer_source and indexer_rope_interleave (steps/models/dsa.py): a shared layer builds no indexer and attends to
its source layer's selection, as GlmMoeDsaAttention does."""

from __future__ import annotations

from steps.models.deepseek_v32.model import DeepseekV32ForCausalLM
from steps.models.glm_moe_dsa.config import GlmMoeDsaConfig


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5 causal LM, without its multi-token-prediction layer."""

    config: GlmMoeDsaConfig
