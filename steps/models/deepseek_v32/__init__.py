"""DeepSeek-V3.2 (transformers' DeepseekV32ForCausalLM: DeepSeek-V3.2 and V3.2-Exp): DeepSeek-V3 with DeepSeek sparse
attention, a lightning indexer in every layer choosing the index_topk keys each query attends to.

As transformers' own modular file does, the family extends DeepSeek-V3's (steps/models/deepseek_v3/: its config
fields and checks, its MoE block and experts, its tensor names), and adds the shared DSA components
(steps/models/dsa.py: the indexer, the indexed attention and decoder layer, the torch engine's decode) over the
shared multi-head latent attention (steps/models/mla.py). config.py (the index fields and what is refused),
model.py, state_dict_adapter.py (the indexer's tensor names) and spec.py (its ModelFamily).
"""
