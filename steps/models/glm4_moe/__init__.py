"""GLM-4.5 / GLM-4.6 (transformers' Glm4MoeForCausalLM, model_type "glm4_moe"): everything moerl knows of this
family, and nothing another needs.

config.py (Glm4MoeConfig: config.json's names and checks, what is refused and why), model.py (its layers over the
shared MoE block with the sigmoid group-limited router and shared experts, and softmax attention with partial
rotary embedding), state_dict_adapter.py (its Hugging Face tensor names: the only place they are written),
decode.py (what the torch engine's decoder reads of it) and spec.py (its ModelFamily, listed by
steps/models/registry.py).
"""
