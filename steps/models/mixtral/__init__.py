"""Mixtral (transformers' MixtralForCausalLM: Mixtral-8x7B, Mixtral-8x22B): everything moerl knows of this family,
and nothing another needs.

config.py (MixtralConfig: config.json's names and checks), model.py (its layers over the shared MoE block and
softmax attention), state_dict_adapter.py (its Hugging Face tensor names: the only place they are listed),
decode.py (what the torch engine's decoder reads of it) and spec.py (its ModelFamily, listed by
steps/models/registry.py).
"""
