"""Qwen3-MoE's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.family import ModelFamily
from steps.models.qwen3_moe.config import ARCHITECTURE, MODEL_TYPE, MoeConfig
from steps.models.qwen3_moe.decode import decode_model
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter

QWEN3_MOE = ModelFamily(
    name="Qwen3-MoE",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=f"Qwen3-MoE (model_type {MODEL_TYPE!r}, {ARCHITECTURE} with num_experts > 0)",
    config=MoeConfig,
    build=MoeForCausalLM,
    state_dict_adapter=Qwen3MoeStateDictAdapter(),
    decode=decode_model,
    attention="softmax_kv_cache",
    router="softmax_topk",
)
