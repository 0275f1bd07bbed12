"""Mixtral's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.family import ModelFamily
from steps.models.mixtral.config import ARCHITECTURE, MODEL_TYPE, MixtralConfig
from steps.models.mixtral.decode import decode_model
from steps.models.mixtral.model import MixtralCausalLM
from steps.models.mixtral.state_dict_adapter import MixtralStateDictAdapter

MIXTRAL = ModelFamily(
    name="Mixtral",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=f"Mixtral (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: untied, head_dim implied, no binding window)",
    config=MixtralConfig,
    build=MixtralCausalLM,
    state_dict_adapter=MixtralStateDictAdapter(),
    decode=decode_model,
    attention="softmax_kv_cache",
    router="softmax_topk",
)
