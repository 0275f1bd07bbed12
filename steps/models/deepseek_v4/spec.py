"""DeepSeek-V4's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.deepseek_v4.config import ARCHITECTURE, MODEL_TYPE, DeepseekV4Config
from steps.models.deepseek_v4.decode import decode_model
from steps.models.deepseek_v4.model import DeepseekV4ForCausalLM
from steps.models.deepseek_v4.state_dict_adapter import DeepseekV4StateDictAdapter
from steps.models.family import ModelFamily

DEEPSEEK_V4 = ModelFamily(
    name="DeepSeek-V4",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=(
        f"DeepSeek-V4 (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: hyper-connections, compressed sparse and heavily "
        "compressed attention, hash-routed first layers; the release's tensor names, bf16/fp32 weights, the "
        "multi-token-prediction module dropped)"
    ),
    config=DeepseekV4Config,
    build=DeepseekV4ForCausalLM,
    state_dict_adapter=DeepseekV4StateDictAdapter(),
    decode=decode_model,
    attention="compressed_kv_cache",
    router="sqrtsoftplus_topk",
)
