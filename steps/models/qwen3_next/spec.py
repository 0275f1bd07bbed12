"""Qwen3-Next's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.family import ModelFamily
from steps.models.gated_hybrid import decode_model
from steps.models.qwen3_next.config import ARCHITECTURE, MODEL_TYPE, Qwen3NextConfig
from steps.models.qwen3_next.model import Qwen3NextCausalLM
from steps.models.qwen3_next.state_dict_adapter import Qwen3NextStateDictAdapter

QWEN3_NEXT = ModelFamily(
    name="Qwen3-Next",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=(
        f"Qwen3-Next (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: gated DeltaNet linear attention beside gated "
        "softmax attention every full_attention_interval layers, a sigmoid-gated shared expert; the torch "
        "engine decodes each layer's state; the multi-token-prediction module dropped)"
    ),
    config=Qwen3NextConfig,
    build=Qwen3NextCausalLM,
    state_dict_adapter=Qwen3NextStateDictAdapter(),
    decode=decode_model,
    attention="recurrent_state",
    router="softmax_topk",
)
