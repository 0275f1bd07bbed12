"""Kimi-K2.5's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.deepseek_v3.decode import decode_model
from steps.models.family import ModelFamily
from steps.models.kimi_k25.config import ARCHITECTURE, MODEL_TYPE, KimiK25Config
from steps.models.kimi_k25.model import KimiK25ForCausalLM
from steps.models.kimi_k25.state_dict_adapter import KimiK25StateDictAdapter, carried

KIMI_K25 = ModelFamily(
    name="Kimi-K2.5",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=(
        f"Kimi-K2.5 (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: Kimi-K2's DeepSeek-V3 language model trained on "
        "text, the MoonViT vision tower and projector carried through unchanged; bf16 experts, not the INT4 release)"
    ),
    config=KimiK25Config,
    build=KimiK25ForCausalLM,
    state_dict_adapter=KimiK25StateDictAdapter(),
    decode=decode_model,
    attention="softmax_kv_cache",
    router="sigmoid_group_topk",
    carried=carried,
)
