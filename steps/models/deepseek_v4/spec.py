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
    # as transformers holds them (_keep_in_fp32_modules_strict) and saves a bf16 model: the hyper-connections, the
    # sinks, the compressors' gate biases, the router bias and every norm (attn_norm, q_norm, kv_norm, ..., norm)
    float32_tensors=("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                     "hc_head_fn", "hc_head_base", "hc_head_scale", ".attn_sink", ".ape", ".gate.bias",
                     "norm.weight"),  # fmt: skip
)
