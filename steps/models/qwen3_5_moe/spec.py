"""Qwen3.5-MoE's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.family import ModelFamily
from steps.models.gated_hybrid import decode_model
from steps.models.qwen3_5_moe.config import ARCHITECTURE, MODEL_TYPE, Qwen3_5MoeConfig
from steps.models.qwen3_5_moe.model import Qwen3_5MoeCausalLM
from steps.models.qwen3_5_moe.state_dict_adapter import Qwen3_5MoeStateDictAdapter, vision_tower

QWEN3_5_MOE = ModelFamily(
    name="Qwen3.5-MoE",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=(
        f"Qwen3.5-MoE (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: Qwen3-Next's hybrid of gated DeltaNet and gated "
        "softmax attention with separate projections and fused experts; the language model trained on text, the "
        "vision tower carried through unchanged; the multi-token-prediction module dropped)"
    ),
    config=Qwen3_5MoeConfig,
    build=Qwen3_5MoeCausalLM,
    state_dict_adapter=Qwen3_5MoeStateDictAdapter(),
    decode=decode_model,
    attention="recurrent_state",
    router="softmax_topk",
    carried=vision_tower,
)
