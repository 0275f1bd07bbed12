"""Qwen2-MoE's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.family import ModelFamily
from steps.models.qwen2_moe.config import ARCHITECTURE, MODEL_TYPE, Qwen2MoeConfig
from steps.models.qwen2_moe.decode import decode_model
from steps.models.qwen2_moe.model import Qwen2MoeForCausalLM
from steps.models.qwen2_moe.state_dict_adapter import Qwen2MoeStateDictAdapter

QWEN2_MOE = ModelFamily(
    name="Qwen2-MoE",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=f"Qwen2-MoE (model_type {MODEL_TYPE!r}, {ARCHITECTURE} with num_experts > 0, no sliding window)",
    config=Qwen2MoeConfig,
    build=Qwen2MoeForCausalLM,
    state_dict_adapter=Qwen2MoeStateDictAdapter(),
    decode=decode_model,
    attention="softmax_kv_cache",
    router="softmax_topk",
)
