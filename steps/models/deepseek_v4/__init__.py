"""DeepSeek-V4 (model_type deepseek_v4): hyper-connections, compressed attention (sliding window with sinks, HCA,
CSA with its indexer), hash-routed and sqrt-softplus-routed MoE layers with clamped SwiGLU experts, under the
release's tensor names. Its shared components: steps/models/hyper_connections.py, compressed_attention.py."""
