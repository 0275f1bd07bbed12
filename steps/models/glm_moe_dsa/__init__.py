"""GLM-5 (transformers' GlmMoeDsaForCausalLM, model_type "glm_moe_dsa"): DeepSeek-V3.2's architecture
(steps/models/deepseek_v32/, which it extends, as transformers' modular file does) with its own defaults, the
indexer's rope interleaved, and indexer layers shared: a "shared" layer attends to the keys the last "full" layer's
indexer selected (indexer_types), with no indexer of its own. config.py, model.py and spec.py; its tensor names are
DeepSeek-V3.2's (an indexer only in the full layers).
"""
