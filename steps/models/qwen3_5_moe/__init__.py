"""Qwen3.5-MoE (transformers' Qwen3_5MoeForConditionalGeneration: Qwen3.5-35B-A3B to 397B-A17B), a vision-language
model whose language model moerl trains on text: everything moerl knows of this family, and nothing another needs.

config.py (Qwen3_5MoeConfig: text_config's and vision_config's names and checks), model.py (its DeltaNet
projections, fused experts and MoE block over the shared hybrid decoder, steps/models/gated_hybrid.py, which also
decodes it; the vision tower carried, steps/models/carried.py), vision.py (the tower's tensors), state_dict_adapter.py
(its Hugging Face tensor names: the only place they are written) and spec.py (its ModelFamily).
"""
