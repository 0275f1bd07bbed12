"""Qwen3-Next (transformers' Qwen3NextForCausalLM: Qwen3-Next-80B-A3B): everything moerl knows of this family, and
nothing another needs.

config.py (Qwen3NextConfig: config.json's names and checks), model.py (its DeltaNet projections, experts and MoE
block over the shared hybrid decoder, steps/models/gated_hybrid.py: gated DeltaNet linear attention in three of every
four layers, gated softmax attention in the others, and the torch engine's decode of both), state_dict_adapter.py
(its Hugging Face tensor names: the only place they are written) and spec.py (its ModelFamily, listed by
steps/models/registry.py).
"""
