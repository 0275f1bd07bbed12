"""MiniMax-M2's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.family import ModelFamily
from steps.models.minimax_m2.config import ARCHITECTURE, MODEL_TYPE, MiniMaxM2Config
from steps.models.minimax_m2.decode import decode_model
from steps.models.minimax_m2.model import MiniMaxM2CausalLM
from steps.models.minimax_m2.state_dict_adapter import MiniMaxM2StateDictAdapter

MINIMAX_M2 = ModelFamily(
    name="MiniMax-M2",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=(
        f"MiniMax-M2 (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: q/k norms over the whole projection, partial "
        "rotary, sigmoid router with a correction bias; bf16 weights, the multi-token-prediction layers dropped)"
    ),
    config=MiniMaxM2Config,
    build=MiniMaxM2CausalLM,
    state_dict_adapter=MiniMaxM2StateDictAdapter(),
    decode=decode_model,
    attention="softmax_kv_cache",
    router="sigmoid_group_topk",
)
