"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM; Moonlight's checkpoints too): everything moerl knows of this
family, and nothing another needs.

config.py (DeepseekConfig: config.json's names and checks, what is refused or dropped), rope.py (default and
YaRN rotary embedding, the softmax scale), model.py (multi-head latent attention and the MoE block with sigmoid
group-limited routing and shared experts, over the shared components), state_dict_adapter.py (its Hugging Face
tensor names: the only place they are written), decode.py (what the torch engine's decoder reads of it) and
spec.py (its ModelFamily, listed by steps/models/registry.py).
"""
