"""MiniMax-M2 (transformers' MiniMaxM2ForCausalLM: MiniMax-M2, M2.1): everything moerl knows of this family, and
nothing another needs.

config.py (MiniMaxM2Config: config.json's names and checks), model.py (its layers over the shared MoE block, the
block_sparse_moe layer and softmax attention), state_dict_adapter.py (its Hugging Face tensor names: the only place
they are listed), decode.py (what the torch engine's decoder reads of it) and spec.py (its ModelFamily, listed by
steps/models/registry.py).
"""
