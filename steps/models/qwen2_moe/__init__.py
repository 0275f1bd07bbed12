"""Qwen2-MoE (transformers' Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): everything moerl knows of this
family, and nothing another needs.

config.py (Qwen2MoeConfig: config.json's names and checks), model.py (its layers over the shared MoE block, with a
sigmoid-gated shared expert, and softmax attention with q/k/v biases), state_dict_adapter.py (its Hugging Face
tensor names: the only place they are written), decode.py (what the torch engine's decoder reads of it) and
spec.py (its ModelFamily, listed by steps/models/registry.py).
"""
