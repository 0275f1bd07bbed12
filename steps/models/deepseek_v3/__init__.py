"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM; Moonlight's checkpoints too): everything moerl knows of this
family, and nothing another needs.

config.py (DeepseekConfig: config.json's names and checks, what is refused or dropped), model.py (the MoE block
with sigmoid group-limited routing and shared experts, over the shared components: multi-head latent attention and
its rotary embedding are steps/models/mla.py), state_dict_adapter.py (its Hugging Face
tensor names: the only place they are written), decode.py (what the torch engine's decoder reads of it) and
spec.py (its ModelFamily, listed by steps/models/registry.py).
"""
