"""DeepSeek-V3's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.deepseek_v3.config import ARCHITECTURE, MODEL_TYPE, DeepseekConfig
from steps.models.deepseek_v3.decode import decode_model
from steps.models.deepseek_v3.model import DeepseekV3ForCausalLM
from steps.models.deepseek_v3.state_dict_adapter import DeepseekV3StateDictAdapter
from steps.models.family import ModelFamily

DEEPSEEK_V3 = ModelFamily(
    name="DeepSeek-V3",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=(
        f"DeepSeek-V3 (model_type {MODEL_TYPE!r} or 'kimi_k2', {ARCHITECTURE}: also Kimi-K2 and Moonlight; bf16/fp32 "
        "weights, multi-token-prediction layers dropped)"
    ),
    config=DeepseekConfig,
    build=DeepseekV3ForCausalLM,
    state_dict_adapter=DeepseekV3StateDictAdapter(),
    decode=decode_model,
    attention="softmax_kv_cache",  # multi-head latent attention, its keys and values materialised per head
    router="sigmoid_group_topk",
)
