"""GLM-4.5 / GLM-4.6's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py
lists."""

from __future__ import annotations

from steps.models.family import ModelFamily
from steps.models.glm4_moe.config import ARCHITECTURE, MODEL_TYPE, Glm4MoeConfig
from steps.models.glm4_moe.decode import decode_model
from steps.models.glm4_moe.model import Glm4MoeForCausalLM
from steps.models.glm4_moe.state_dict_adapter import Glm4MoeStateDictAdapter

GLM4_MOE = ModelFamily(
    name="GLM-4-MoE",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=f"GLM-4.5/4.6 (model_type {MODEL_TYPE!r}, {ARCHITECTURE}, multi-token-prediction layers dropped)",
    config=Glm4MoeConfig,
    build=Glm4MoeForCausalLM,
    state_dict_adapter=Glm4MoeStateDictAdapter(),
    decode=decode_model,
    attention="softmax_kv_cache",
    router="sigmoid_group_topk",
)
