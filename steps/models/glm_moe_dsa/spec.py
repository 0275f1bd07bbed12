"""GLM-5's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.deepseek_v32.state_dict_adapter import DeepseekV32StateDictAdapter
from steps.models.dsa import decode_model
from steps.models.family import ModelFamily
from steps.models.glm_moe_dsa.config import ARCHITECTURE, MODEL_TYPE, GlmMoeDsaConfig
from steps.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM

GLM_MOE_DSA = ModelFamily(
    name="GLM-5",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=(
        f"GLM-5 (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: DeepSeek-V3.2's sparse attention with shared indexer "
        "layers; bf16/fp32 weights, the multi-token-prediction layer dropped)"
    ),
    config=GlmMoeDsaConfig,
    build=GlmMoeDsaForCausalLM,
    state_dict_adapter=DeepseekV32StateDictAdapter(),
    decode=decode_model,
    attention="indexed_kv_cache",
    router="sigmoid_group_topk",
    float32_tensors=(".indexer.weights_proj.weight",),  # as DeepSeek-V3.2's
)
