"""gpt-oss (transformers' GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): everything moerl knows of this family, and
nothing another needs.

config.py (GptOssConfig: config.json's names and checks), rope.py (its YaRN rotary tables), model.py (its layers:
attention with biases, sinks and alternating sliding windows; the shared MoE block with a biased top-k-softmax
router and clamped-SwiGLU experts with biases), state_dict_adapter.py (its Hugging Face tensor names, a layer's
experts fused in one tensor per weight: the only place they are listed), decode.py (what the torch engine's
decoder reads of it), mxfp4.py (the Hub's MXFP4 experts dequantized to bf16 on import) and spec.py (its
ModelFamily, listed by steps/models/registry.py).
"""
