"""gpt-oss's registration: its ModelFamily (steps/models/family.py), which steps/models/registry.py lists."""

from __future__ import annotations

from steps.models.family import ModelFamily
from steps.models.gpt_oss.config import ARCHITECTURE, MODEL_TYPE, GptOssConfig
from steps.models.gpt_oss.decode import decode_model
from steps.models.gpt_oss.model import GptOssCausalLM
from steps.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

GPT_OSS = ModelFamily(
    name="gpt-oss",
    model_type=MODEL_TYPE,
    architectures=(ARCHITECTURE,),
    description=f"gpt-oss (model_type {MODEL_TYPE!r}, {ARCHITECTURE}: float weights; MXFP4 experts dequantized to "
    "bf16 on import)",
    config=GptOssConfig,
    build=GptOssCausalLM,
    state_dict_adapter=GptOssStateDictAdapter(),
    decode=decode_model,
    attention="softmax_kv_cache",
    router="topk_softmax",
)
