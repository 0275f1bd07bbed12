"""DeepSeek-V3.2's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.deepseek_v32.config import ARCHITECTURE, MODEL_TYPE, DeepseekV32Config
from steps.models.deepseek_v32.model import DeepseekV32ForCausalLM
from steps.models.deepseek_v32.state_dict_adapter import DeepseekV32StateDictAdapter
from steps.models.dsa import decode_model
from steps.models.family import ModelFamily

DEEPSEEK_V32 = ModelFamily(
    name="DeepSeek-V3.2",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=(
        f"DeepSeek-V3.2 (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: DeepSeek-V3 with DeepSeek sparse attention, the "
        "lightning indexer frozen; bf16/fp32 weights, the multi-token-prediction layer dropped)"
    ),
    config=DeepseekV32Config,
    build=DeepseekV32ForCausalLM,
    state_dict_adapter=DeepseekV32StateDictAdapter(),
    decode=decode_model,
    attention="indexed_kv_cache",
    router="sigmoid_group_topk",
    float32_tensors=(".indexer.weights_proj.weight",),  # as transformers holds it (_keep_in_fp32_modules)
)
