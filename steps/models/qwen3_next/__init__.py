"""Qwen3-Next (transformers' Qwen3NextForCausalLM: Qwen3-Next-80B-A3B): everything moerl knows of this family, and
nothing another needs.

config.py (Qwen3NextConfig: config.json's names and checks), model.py (its hybrid layers: gated DeltaNet linear
attention, steps/models/gated_deltanet.py, in three of every four layers, gated softmax attention in the others, the
shared MoE block with a sigmoid-gated shared expert), state_dict_adapter.py (its Hugging Face tensor names: the only
place they are written), decode.py (the torch engine has no decoder for it yet: it says so) and spec.py (its
ModelFamily, listed by steps/models/registry.py).
"""
