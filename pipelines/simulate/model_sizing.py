"""What the simulator knows of the model: parameter counts, bytes of a version and training FLOPs per token from a
checkpoint's config.json, for every family moerl loads (steps/models/registry.py), and the trainer's memory per GPU.

Counts are shape-only: the family's state-dict adapter lists every tensor a checkpoint holds (expected_shapes, no
weights, no model built) and names one routed expert's parameters (expert_params), which splits the routed experts
from the rest (embeddings, attention, routers, norms, dense layers and shared experts: every token uses those).

    total       every tensor of the checkpoint (no multi-token-prediction layers: moerl drops them on import)
    expert      the routed experts of every MoE layer
    non_expert  total - expert
    carried     of non_expert, the tensors kept and published unchanged, never computed with on text (a
                vision-language checkpoint's vision tower: the family's carried tensors): no gradient, no
                optimizer state, not in active
    active      non_expert - carried + expert x num_experts_per_tok / num_experts: the parameters one token goes
                through, with the input embedding, as most model cards count "activated parameters"
    compute     active less the input embedding (a table lookup, no multiply): the N of the FLOPs formula

Training FLOPs per token (forward + backward), the accounting of PaLM (Chowdhery et al. 2022, Appendix B, "model
FLOPs"), which is Kaplan et al. 2020's / Chinchilla's 6N with the attention term written out as Megatron-LM's
(Narayanan et al. 2021) does:

    6 x compute  +  6 x sum over layers of heads x (d_qk + d_v) x T_layer

with T_layer the sequence length (min(T, window) on a sliding-window layer). With d_qk = d_v = head_dim it is PaLM's
6N + 12 x layers x heads x head_dim x T; multi-head latent attention (DeepSeek-V3) has d_qk = qk_nope_head_dim +
qk_rope_head_dim (192) and d_v = v_head_dim (128). The full (not causal-halved) attention is counted, as PaLM does.

DeepSeek sparse attention (DeepSeek-V3.2, GLM-5: index_topk): each query attends to at most index_topk keys, so the
attention term's T_layer is min(T, index_topk), as a window's; its lightning indexer scores every earlier key,
index_n_heads x index_head_dim multiply-adds a key in the forward only (it is frozen, under no_grad): 2 x heads x dim
x T a token and layer, added to the FLOPs. The engine keeps each token's index key beside the MLA latent:
index_head_dim FP8 bytes and a float32 scale per 128 (SGLang 0.5.17's DSATokenToKVPool, mem_cache/memory_pool.py:
4384-4389). GLM-5's shared layers run no indexer (they reuse an earlier layer's selection): no scoring and no index
keys there.

Linear attention (Qwen3-Next's gated DeltaNet layers, layer_types "linear_attention"): no term in T. Its projections
(in_proj_qkvz, in_proj_ba, out_proj) and its depthwise causal conv1d (channels x K multiply-adds a token, as many as
its weights) are parameters, in the 6N; the state update is counted as the recurrent form's multiply-adds a token
and value head, 4 x d_k x d_v: the decay of the d_k x d_v state, S^T k (the prediction of v), the rank-one delta-rule
write k (beta (v - S^T k))^T, and the read S^T q. So a DeltaNet layer adds 6 x 4 x Hv x d_k x d_v to the FLOPs of a
token, and only the full-attention layers have the heads x (d_qk + d_v) x T term. The chunked kernel training runs
(chunk 64) does more than the recurrent form (its intra-chunk products, the WY representation): not counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steps.errors import MoerlError

GB = 1e9  # decimal gigabytes throughout the simulator

# The published config.json of Qwen/Qwen3-30B-A3B (the architecture fields): the model the built-in GPU
# assumptions (sizing.py GPU_ASSUMPTIONS) were written for, and what another model's figures are scaled against.
REFERENCE_NAME = "Qwen3-30B-A3B"
REFERENCE_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSizing:
    """A model's sizes (see the module docstring for each count's definition)."""

    name: str  # what the printout calls it (the config's source)
    model_type: str
    total: int
    expert: int
    non_expert: int
    active: int
    compute: int
    embedding: int  # the input embedding table
    unembedding: int  # the output projection (lm_head; 0 when tied to the embedding)
    num_experts: int
    experts_per_token: int
    dtype_bytes: int  # a weight as a version stores it (the checkpoint's dtype)
    # (heads, d_qk, d_v, window or None) of each layer: the attention term of the FLOPs
    attention: tuple[tuple[int, int, int, int | None], ...]
    hidden_size: int
    vocab_size: int
    # per layer, per token, the activations a layer keeps for its backward (elements; see activation_elements)
    layer_activation_elements: tuple[int, ...]
    # the rollout engine's KV cache: a token keeps kv_elements_per_head values (keys and values, every layer) for
    # each of kv_heads heads; multi-head latent attention keeps one latent "head" (kv_lora_rank + rope dims)
    kv_heads: int = 0
    kv_elements_per_head: int = 0
    # (value heads, d_k, d_v) of each linear-attention (gated DeltaNet) layer: its state update in the FLOPs
    linear_attention: tuple[tuple[int, int, int], ...] = ()
    # the rollout engine's linear-attention state of one sequence, whatever its length, every DeltaNet layer: conv
    # state and fp32 recurrent state (bytes, whole model; split over TP by sequence_state_bytes); 0 without any
    state_bytes_per_sequence: int = 0
    # what that state is (the memory table's words), and whether TP splits it (DeltaNet's heads are; DeepSeek-V4's one
    # shared key=value head of its sliding windows is on every rank)
    sequence_state: str = "linear-attention state"
    sequence_state_detail: str = "DeltaNet conv and fp32 recurrent states"
    sequence_state_split_by_tp: bool = True
    # the tensors carried unchanged (a vision tower; module docstring): in total and non_expert, not in active
    carried: int = 0
    # the frozen parameters (the lightning indexers, steps/models/family.py FROZEN_MODULES): in total, non_expert
    # and active (they run every token), held as weights, with no gradient or optimizer state
    frozen: int = 0
    # (index heads, index head dim) of each layer with a lightning indexer (DeepSeek sparse attention): its scores
    index_scoring: tuple[tuple[int, int], ...] = ()
    # the engine's index keys of one token, every layer (bytes, not split by TP)
    index_key_bytes_per_token: int = 0
    # (heads, d_qk + d_v, rate, top-k or None) of each layer's compressed entries (DeepSeek-V4): a query attends to
    # T / rate of them (at most top-k, CSA's indexer), beside its sliding window (in `attention`)
    compressed_attention: tuple[tuple[int, int, int, int | None], ...] = ()
    # (index heads, index head dim, rate) of each compressed sparse layer's indexer: it scores T / rate entries
    compressed_index_scoring: tuple[tuple[int, int, int], ...] = ()

    @property
    def version_bytes(self) -> float:
        """One version's weights in the checkpoint's dtype."""
        return float(self.total * self.dtype_bytes)

    def engine_weight_bytes(self, tp: int, ep: int) -> float:
        """One GPU's bf16 weights in an engine of TP tp and EP ep: the non-expert ones split over tp, the experts
        over ep."""
        return 2.0 * (self.non_expert / tp + self.expert / ep)

    def kv_bytes_per_token(self, tp: int) -> int:
        """One GPU's bf16 KV cache of a token in an engine of TP tp: kv_heads / tp heads (at least one; MLA's
        single latent on every rank) of kv_elements_per_head values (SGLang's cell size, _kv_cache_shape)."""
        return max(1, self.kv_heads // tp) * self.kv_elements_per_head * 2 + self.index_key_bytes_per_token

    def sequence_state_bytes(self, tp: int) -> float:
        """One GPU's fixed state of one sequence in an engine of TP tp (SGLang splits the DeltaNet heads, and so the
        conv and recurrent states, over TP; DeepSeek-V4's sliding windows are whole on every rank); 0 for a model
        without one."""
        return self.state_bytes_per_sequence / (tp if self.sequence_state_split_by_tp else 1)

    @property
    def active_non_embedding(self) -> int:
        """active less the input embedding and the output projection (as some cards count, e.g. GLM-4.5's)."""
        return self.active - self.embedding - self.unembedding

    @property
    def optimizer_bytes(self) -> float:
        """The AdamW state a candidate carries: fp32 masters, exp_avg and exp_avg_sq (12 bytes a parameter; the
        carried and the frozen tensors have none)."""
        return 12.0 * (self.total - self.carried - self.frozen)

    @property
    def replicated_fraction(self) -> float:
        return self.non_expert / self.total

    def flops_per_token(self, seq_len: float) -> float:
        """Training (forward + backward) FLOPs of one token at context `seq_len` (module docstring)."""
        attention = sum(h * (dqk + dv) * (min(seq_len, w) if w else seq_len) for h, dqk, dv, w in self.attention)
        linear = sum(4 * hv * dk * dv for hv, dk, dv in self.linear_attention)
        compressed = sum(
            h * d * (min(seq_len / r, k) if k else seq_len / r) for h, d, r, k in self.compressed_attention
        )
        index = sum(h * d for h, d in self.index_scoring) * seq_len  # forward only: the indexer is frozen
        index += sum(h * d * seq_len / r for h, d, r in self.compressed_index_scoring)
        return 6.0 * self.compute + 6.0 * (attention + compressed) + 6.0 * linear + 2.0 * index

    def summary(self) -> str:
        def b(n: float) -> str:
            return f"{n / 1e9:,.1f}B"

        carried = f"; {b(self.carried)} carried unchanged (the vision tower)" if self.carried else ""
        return (f"{b(self.total)} parameters ({b(self.expert)} in {self.num_experts} routed experts, "
                f"{b(self.non_expert)} outside them{carried}), {b(self.active)} active a token "
                f"(top-{self.experts_per_token}), {self.version_bytes / GB:,.1f} GB a version")  # fmt: skip


def _family_config(d: dict[str, Any], source: str) -> Any:
    """The family's validated config of a config.json dict, sized as the float checkpoint moerl would hold: a
    quantization_config (DeepSeek-V3's fp8, gpt-oss's MXFP4, which import dequantizes, Kimi-K2.5's INT4 experts, at
    the top level or in text_config) is set aside, as are the multi-token-prediction layers (moerl's import drops
    them)."""
    from steps.models.registry import config_from_hf

    d = {k: v for k, v in d.items() if k != "quantization_config"}
    if isinstance(d.get("text_config"), dict):
        d["text_config"] = {k: v for k, v in d["text_config"].items() if k != "quantization_config"}
    return config_from_hf(d, source=source)


def _head_dims(cfg: Any) -> tuple[int, int]:
    if getattr(cfg, "qk_nope_head_dim", None) is not None:  # multi-head latent attention
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return head, head


def _dense_intermediate(cfg: Any, layer: int) -> int:
    """The always-on MLP width of a layer: a dense layer's intermediate_size, a MoE layer's shared experts'."""
    if not cfg.is_moe_layer(layer):
        return int(cfg.intermediate_size)
    shared = getattr(cfg, "n_shared_experts", None)
    if shared:
        return int(shared * cfg.moe_intermediate_size)
    shared_size = getattr(cfg, "shared_expert_intermediate_size", None)  # Qwen2-MoE's shared expert
    return int(shared_size or 0)


def _is_linear_attention(cfg: Any, layer: int) -> bool:
    """Whether a layer's token mixer is linear attention (Qwen3-Next's gated DeltaNet), not softmax attention."""
    check = getattr(cfg, "is_linear_attention", None)
    return bool(check(layer)) if callable(check) else False


def _deltanet_dims(cfg: Any) -> tuple[int, int, int, int, int]:
    """(key heads, value heads, d_k, d_v, conv channels) of a gated DeltaNet layer."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return hk, hv, dk, dv, 2 * hk * dk + hv * dv


def linear_attention_state_bytes(cfg: Any) -> int:
    """The rollout engine's state of one sequence over every DeltaNet layer (SGLang's mamba state pool for
    Qwen3-Next): the causal conv1d's last K - 1 inputs of each of its 2 Hk d_k + Hv d_v channels (bf16, the model's
    dtype; causal_conv1d's initial_states are (channels, K - 1), as vLLM's MambaStateShapeCalculator sizes them;
    transformers' own cache keeps K) and the delta rule's Hv x d_k x d_v recurrent state (fp32)."""
    layers = sum(1 for layer in range(cfg.num_hidden_layers) if _is_linear_attention(cfg, layer))
    if not layers:
        return 0
    _, hv, dk, dv, channels = _deltanet_dims(cfg)
    conv = channels * (cfg.linear_conv_kernel_dim - 1) * 2
    recurrent = hv * dk * dv * 4
    return layers * (conv + recurrent)


def activation_elements(cfg: Any, layer: int, expert_intermediate: int) -> int:
    """A rough count of the values one layer keeps per token for its backward with every activation kept and a
    flash-style attention (no T x T matrix): the norms' and residual's inputs and outputs (6h), the queries, keys,
    values and attention output (heads x (2 d_qk + d_v) with keys and values at the query heads' count for MLA,
    kv_heads for GQA), the router's logits (E), then per chosen expert its copy of the input and its gate, up and
    gated products (h + 3I), and the same for the always-on MLP (h + 3I_dense). Qwen3-Next: a full-attention layer
    also keeps its output gate (heads x d_v); a gated DeltaNet layer instead of attention keeps its in_proj_qkvz and
    in_proj_ba outputs (2 Hk d_k + 2 Hv d_v + 2 Hv), the conv1d's output (2 Hk d_k + Hv d_v), the delta rule's output
    and the gated norm's (2 Hv d_v): the chunked kernel's own intermediates are not counted; DeepSeek-V4 keeps its
    blocks' hc_mult-wide residual streams (4 (hc_mult - 1) h more). Korthikanti et al.
    2022 ("Reducing Activation Recomputation in Large Transformer Models") count a dense layer so (34 s b h bytes at
    16 bits).
    Against the bytes autograd saves in moerl's own Qwen3-MoE layer (fp32, CPU; tests/test_simulate_model_sizing.py):
    Qwen3-30B-A3B's layer keeps ~237 KB a token where the formula says 226 KB (the fit's linear term, which also
    holds the embedding's and a small test vocabulary's share), a small layer 8.6 KB against the formula's 9.8 KB.
    On the CPU the math attention also keeps heads x T^2 fp32 probabilities; CUDA's memory-efficient kernel, which
    takes the trainer's masks, keeps none."""
    h = cfg.hidden_size
    dqk, dv = _head_dims(cfg)
    heads = cfg.num_attention_heads
    kv_heads = heads if getattr(cfg, "qk_nope_head_dim", None) is not None else cfg.num_key_value_heads
    attention = heads * dqk + kv_heads * (dqk + dv) + heads * dv
    if _is_linear_attention(cfg, layer):
        hk, hv, dk, dv_lin, channels = _deltanet_dims(cfg)
        attention = (2 * hk * dk + 2 * hv * dv_lin + 2 * hv) + channels + 2 * hv * dv_lin
    elif getattr(cfg, "linear_num_value_heads", None) is not None:  # Qwen3-Next's gated softmax attention
        attention += heads * dv
    mlp = 0
    if cfg.is_moe_layer(layer):
        mlp += cfg.num_experts + cfg.num_experts_per_tok * (h + 3 * expert_intermediate)
    dense = _dense_intermediate(cfg, layer)
    if dense:
        mlp += h + 3 * dense
    # DeepSeek-V4's hyper-connections: each block's input and output are hc_mult streams, not one
    streams = 4 * (getattr(cfg, "hc_mult", 1) - 1) * h
    return 6 * h + attention + mlp + streams


def model_sizing(d: dict[str, Any], source: str = "config.json") -> ModelSizing:
    """The sizes of the model a config.json dict describes (any family moerl loads); one MoerlError otherwise."""
    from steps.models.family import is_frozen
    from steps.models.hf_checkpoint import declared_dtype, expected_tensor_shapes
    from steps.models.registry import family_of

    cfg = _family_config(d, source)
    adapter = family_of(cfg).state_dict_adapter
    shapes = expected_tensor_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    # (DeepSeek-V4's release names them embed.weight and head.weight)
    embedding = sum(math.prod(s) for name, s in shapes.items() if name.endswith("embed_tokens.weight")
                    or name == "embed.weight")  # fmt: skip
    unembedding = sum(math.prod(s) for name, s in shapes.items() if name in ("lm_head.weight", "head.weight"))
    layers = cfg.num_hidden_layers
    moe_layers = [layer for layer in range(layers) if cfg.is_moe_layer(layer)]
    expert_intermediate = 0
    expert = 0
    for m in range(len(moe_layers)):
        one = adapter.expert_params(cfg, m, 0)  # every expert of a layer has the same shapes
        expert += cfg.num_experts * sum(math.prod(s) for _, s in one)
    if moe_layers:
        expert_intermediate = int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    non_expert = total - expert
    carried = sum(math.prod(s) for s in family_of(cfg).carried_shapes(cfg).values())
    frozen = sum(math.prod(s) for name, s in shapes.items() if is_frozen(name))
    active = non_expert - carried + expert * cfg.num_experts_per_tok // cfg.num_experts
    dqk, dv = _head_dims(cfg)
    window = getattr(cfg, "window", None)
    compressed = _compressed_attention(cfg)  # DeepSeek-V4 (its index_topk is its CSA layers' entries: below)
    index_topk = None if compressed else getattr(cfg, "index_topk", None)  # DSA: at most index_topk keys a query
    indexed: list[int] = []  # the layers that run an indexer (GLM-5's shared layers reuse another's selection)
    if index_topk is not None:
        window = lambda layer: index_topk  # noqa: E731
        source = getattr(cfg, "indexer_source", lambda layer: layer)
        indexed = [layer for layer in range(layers) if source(layer) == layer]
    if compressed:  # DeepSeek-V4: every layer's own keys within its sliding window, beside the compressed entries
        window = lambda layer: cfg.sliding_window  # noqa: E731
    linear_layers = [layer for layer in range(layers) if _is_linear_attention(cfg, layer)]
    attention = tuple(
        (cfg.num_attention_heads, dqk, dv, window(layer) if callable(window) else None)
        for layer in range(layers)
        if layer not in linear_layers
    )
    linear_attention = tuple(_deltanet_dims(cfg)[1:4] for _ in linear_layers)
    dtype = declared_dtype(d, source)
    dtype_bytes = _DTYPE_BYTES[str(dtype).removeprefix("torch.")] if dtype is not None else 2
    sizes: dict[str, Any] = dict(
        name=source,
        model_type=str(d.get("model_type")),
        total=total,
        expert=expert,
        non_expert=non_expert,
        active=active,
        compute=active - embedding,
        embedding=embedding,
        unembedding=unembedding,
        num_experts=cfg.num_experts,
        experts_per_token=cfg.num_experts_per_tok,
        dtype_bytes=dtype_bytes,
        attention=attention,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        layer_activation_elements=tuple(activation_elements(cfg, i, expert_intermediate) for i in range(layers)),
        linear_attention=linear_attention,
        state_bytes_per_sequence=linear_attention_state_bytes(cfg),
        carried=carried,
        frozen=frozen,
        index_scoring=tuple((cfg.index_n_heads, cfg.index_head_dim) for _ in indexed),
        index_key_bytes_per_token=len(indexed) * (cfg.index_head_dim + cfg.index_head_dim // 128 * 4) if indexed else 0,
        **_kv_cache_shape(cfg),
    )
    sizes.update(compressed)  # DeepSeek-V4's cache and attention terms replace the softmax ones
    return ModelSizing(**sizes)


def _compressed_attention(cfg: Any) -> dict[str, Any]:
    """DeepSeek-V4's attention terms and engine cache (steps/models/compressed_attention.py), {} for other models.

    FLOPs: each layer's sliding window of one shared key=value head (as a window in `attention`), and each compressed
    layer's entries (T / rate, CSA's at most index_topk) at every head; the CSA indexer scores T / rate entries.
    The engine's cache a token (SGLang 0.5.17 keeps DeepSeek-V4's in FP8 by default: moerl counts bf16, as for every
    model): one compressed entry of head_dim every `rate` tokens per compressed layer, and CSA's index key of
    index_head_dim (FP8 + a 4-byte scale a 128 values, as DeepSeek-V3.2's) every 4; the sliding windows are a fixed
    state a sequence (sliding_window keys of head_dim, every layer)."""
    rates = getattr(cfg, "compress_rates", None)
    if rates is None:
        return {}
    layers = range(cfg.num_hidden_layers)
    kinds = [cfg.layer_types[layer] for layer in layers]
    compressed = [layer for layer in layers if kinds[layer] != "sliding_attention"]
    sparse = [layer for layer in compressed if kinds[layer] == "compressed_sparse_attention"]
    heads, d = cfg.num_attention_heads, cfg.head_dim
    entries = sum(d / cfg.compress_rate(layer) for layer in compressed)
    index_key = cfg.index_head_dim + cfg.index_head_dim // 128 * 4
    index_bytes = sum(index_key / cfg.compress_rate(layer) for layer in sparse)
    return {
        "compressed_attention": tuple(
            (heads, 2 * d, cfg.compress_rate(layer), cfg.index_topk if layer in sparse else None)
            for layer in compressed
        ),
        "compressed_index_scoring": tuple(
            (cfg.index_n_heads, cfg.index_head_dim, cfg.compress_rate(layer)) for layer in sparse
        ),
        "kv_heads": 1,
        "kv_elements_per_head": math.ceil(entries),
        "index_key_bytes_per_token": math.ceil(index_bytes),
        "state_bytes_per_sequence": cfg.sliding_window * d * cfg.num_hidden_layers * 2,
        "sequence_state": "sliding-window keys",
        "sequence_state_detail": "one shared key=value head, every layer",
        "sequence_state_split_by_tp": False,
    }


def _kv_cache_shape(cfg: Any) -> dict[str, int]:
    """What a token keeps in SGLang's KV cache (v0.5.17, mem_cache/pool_configurator.py _compute_cell_size): for
    MLA one latent of kv_lora_rank + qk_rope_head_dim a layer, not split by TP; otherwise keys and values of each
    KV head a layer (head_dim each), the heads split by TP. Only the softmax-attention layers keep keys and values:
    Qwen3-Next's gated DeltaNet layers keep a state of fixed size a sequence instead (linear_attention_state_bytes;
    SGLang's HybridLinearKVPool holds the full-attention layers' cache alone)."""
    layers = sum(1 for layer in range(cfg.num_hidden_layers) if not _is_linear_attention(cfg, layer))
    if getattr(cfg, "kv_lora_rank", None):
        return {"kv_heads": 1, "kv_elements_per_head": (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * layers}
    dqk, dv = _head_dims(cfg)
    return {"kv_heads": int(cfg.num_key_value_heads), "kv_elements_per_head": (dqk + dv) * layers}


def reference_sizing() -> ModelSizing:
    return model_sizing(REFERENCE_CONFIG, source=f"{REFERENCE_NAME} (built in)")


def read_model_config(path: Path) -> dict[str, Any]:
    """A config.json file (--model-config): a checkpoint directory or the file itself."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise MoerlError(f"--model-config {path}: cannot read it as a config.json ({err})") from None
    if not isinstance(d, dict):
        raise MoerlError(f"--model-config {path}: not a JSON object")
    return d


def fetch_model_config(uri: str) -> dict[str, Any]:
    """The config.json of a checkpoint through the run's store (as pipelines/preflight.py reads the small files);
    raises when the store cannot be reached or holds none."""
    from steps.store.object_store import Store
    from steps.store.s3 import RetryPolicy

    store = Store.open(uri, RetryPolicy(max_attempts=1))
    d = json.loads(store.get_bytes("config.json", verify=False))
    if not isinstance(d, dict):
        raise MoerlError(f"{uri}/config.json: not a JSON object")
    return d


# ---------------------------------------------------------------------------------------------- memory


# GPU memory of the instance types the configs name (node.kubernetes.io/instance-type), in GB as NVIDIA states it.
INSTANCE_GPUS: dict[str, tuple[str, float]] = {
    "p5en.48xlarge": ("H200", 141.0),
    "p5e.48xlarge": ("H200", 141.0),
    "p5.48xlarge": ("H100", 80.0),
    "p5.4xlarge": ("H100", 80.0),
    "p6-b200.48xlarge": ("B200", 179.0),
    "p4de.24xlarge": ("A100 80GB", 80.0),
    "p4d.24xlarge": ("A100 40GB", 40.0),
}


@dataclass(frozen=True)
class MemoryTable:
    rows: tuple[tuple[str, float], ...]  # (what, GB a GPU)
    gpu: str
    capacity_gb: float  # 0: unknown
    formula: str
    budget: str = ""  # what capacity_gb is, when not the whole GPU ("SGLang's mem_fraction 0.85 of the H200")

    @property
    def total_gb(self) -> float:
        return sum(gb for _, gb in self.rows)

    @property
    def fits(self) -> bool | None:
        return None if not self.capacity_gb else self.total_gb <= self.capacity_gb

    def lines(self) -> list[str]:
        width = max(len(what) for what, _ in self.rows) + 2
        out = [f"    {what.ljust(width)}{gb:10,.1f} GB" for what, gb in self.rows]
        out.append(f"    {'total'.ljust(width)}{self.total_gb:10,.1f} GB")
        if self.capacity_gb:
            headroom = self.capacity_gb - self.total_gb
            verdict = "fits" if headroom >= 0 else "does NOT fit"
            where = self.budget or f"the {self.gpu}'s"
            out.append(f"    {verdict} in {where} {self.capacity_gb:,.0f} GB: headroom {headroom:,.1f} GB"
                       f" ({headroom / self.capacity_gb:+.0%})")  # fmt: skip
        else:
            out.append(f"    the GPU's memory is unknown ({self.gpu}): name its instance type in the placement")
        out.append(f"    ({self.formula})")
        return out


def trainer_memory(
    m: ModelSizing,
    ep: int,
    dp: int,
    micro_batch: int,
    seq_len: int,
    kl_ref: bool,
    gpu: str,
    capacity_gb: float,
    activation_checkpointing: bool = False,
    deepep_ranks: tuple[int, int] | None = None,
    fsdp: bool = False,
    shard_experts: bool = False,
) -> MemoryTable:
    """GB a trainer GPU holds, as today's trainer lays a model out: the routed experts split over the EP group's
    ep ranks, every other parameter (and its optimizer state) replicated on every rank, nothing sharded over the
    dp replicas; AdamW with fp32 state; the activations of a micro-batch of micro_batch rows of seq_len tokens
    (fp32, as the trainer computes today): every one kept, or with activation_checkpointing each layer's input
    (h a token) plus one layer's activations at a time (the layer the backward is running again). deepep_ranks:
    (EP ranks, of them in one NVLink domain) when the experts exchange through DeepEP: its buffer. fsdp: the
    non-expert parameters and their state split over all ep x dp ranks (trainer.fsdp), each layer's gathered whole
    around its forward and backward (the next one's already coming: two layers' worth). shard_experts: each EP
    rank's experts and their state split over its dp replicas (trainer.shard_experts), a layer's gathered the
    same way."""
    ranks = ep * dp
    trained = m.non_expert - m.carried  # the carried tensors: held below, no gradient or optimizer state
    non_expert = trained / ranks if fsdp else trained
    expert = m.expert / ep / (dp if shard_experts else 1)
    params = non_expert + expert
    frozen = m.frozen / ranks if fsdp else m.frozen  # weights only (the indexers: no gradient, no AdamW state)
    rows: list[tuple[str, float]] = [
        ("weights (bf16)", 2 * params / GB),
        ("gradients (bf16)", 2 * (params - frozen) / GB),
        ("fp32 master weights", 4 * (params - frozen) / GB),
        ("AdamW moments (fp32 exp_avg, exp_avg_sq)", 8 * (params - frozen) / GB),
    ]
    if m.carried:
        rows.append(("carried unchanged (the vision tower, fp32 buffers)", 4 * m.carried / GB))
    if fsdp:
        layers = max(1, len(m.layer_activation_elements))
        per_layer = (trained - m.embedding - m.unembedding) / layers
        rows.append(("FSDP: two layers' non-expert parameters gathered whole (fp32)", 2 * 4 * per_layer / GB))
        rows.append(("FSDP: embeddings and output projection gathered whole (fp32)",
                     4 * (m.embedding + m.unembedding) / GB))  # fmt: skip
    if shard_experts and dp > 1:
        moe_layers = max(1, len(m.layer_activation_elements))  # every layer may be a MoE layer: the bound
        rows.append(("shard_experts: two layers' local experts gathered whole (fp32)",
                     2 * 4 * m.expert / ep / moe_layers / GB))  # fmt: skip
    if kl_ref:
        rows.append(("reference policy (kl_coef > 0, fp32)", 4 * (trained + m.expert / ep) / GB))
    tokens = micro_batch * seq_len
    if activation_checkpointing:
        layers = len(m.layer_activation_elements)
        rows.append((f"layer inputs kept ({micro_batch} x {seq_len:,} tokens x {layers} layers, fp32)",
                     4 * tokens * m.hidden_size * layers / GB))  # fmt: skip
        one_layer = 4 * tokens * max(m.layer_activation_elements) / GB
        rows.append(("one layer's activations, run again in the backward", one_layer))
    else:
        per_token = sum(m.layer_activation_elements)
        rows.append((f"activations ({micro_batch} x {seq_len:,} tokens, fp32)", 4 * tokens * per_token / GB))
    rows.append(("logits and log-softmax (fp32)", 2 * 4 * tokens * m.vocab_size / GB))
    if deepep_ranks is not None:
        ranks, nvl = deepep_ranks
        rows.append((f"DeepEP buffer ({ranks} EP ranks, {tokens:,} tokens a rank)",
                     deepep_buffer_bytes(ranks, nvl, tokens, m.hidden_size, m.experts_per_token) / GB))  # fmt: skip
    held = "non-expert / (EP x DP) (trainer.fsdp)" if fsdp else "non-expert"
    held_experts = "expert / (EP x DP) (trainer.shard_experts)" if shard_experts else "expert / EP"
    formula = (f"EP {ep} x DP {dp}: {params / 1e9:,.2f}B parameters a GPU = {held} + {held_experts}; 16 bytes each "
               "(bf16 weights and gradients, fp32 masters, two fp32 AdamW moments; today's trainer keeps fp32 "
               "weights and gradients instead: the same 16); activations ~ 4 bytes x micro-batch x sequence x "
               "sum over layers of (6h + attention q/k/v/out + E router logits + k x (h + 3 I_expert) "
               "+ h + 3 I_dense), "
               + ("each layer's input kept and one layer at a time run again (trainer.activation_checkpointing)"
                  if activation_checkpointing else "every one kept (trainer.activation_checkpointing: false)")
               + ", flash attention; DeepEP's buffer as dd758ca sizes it; NCCL's own buffers not counted")  # fmt: skip
    return MemoryTable(tuple(rows), gpu, capacity_gb, formula)


def deepep_buffer_bytes(ranks: int, nvl_ranks: int, tokens: int, hidden: int, top_k: int) -> float:
    """GPU bytes of the DeepEP ElasticBuffer a trainer rank makes (steps/expert_parallel/deepep.py: bf16 dispatch,
    hybrid mode and multiple reduction on, DeepEP's defaults), as DeepEP dd758ca sizes it: csrc/elastic/buffer.hpp
    calculate_buffer_size, the larger of the dispatch and combine buffers aligned to 2 MiB, plus the 14 MiB
    workspace. A token's slot is its bf16 hidden row and its top-k metadata, each 32-byte aligned
    (layout.cuh TokenLayout); within one NVLink domain the dispatch buffer holds every rank's tokens and the
    combine buffer min(ranks, k) copies; across nodes (hybrid: scale-out S = ranks / nvl_ranks, scale-up nvl_ranks)
    both add scale-out send and receive space."""

    def a32(n: int) -> int:
        return -(-n // 32) * 32

    k = top_k or 32
    dispatch_token = a32(2 * hidden) + a32(12 * k + 4)
    combine_token = a32(2 * hidden) + a32(8 * k)
    if ranks <= nvl_ranks:
        dispatch = dispatch_token * tokens * ranks
        combine = combine_token * tokens * min(ranks, k)
    else:
        scale_out = ranks // nvl_ranks
        dispatch = dispatch_token * ((ranks + 1) * tokens + scale_out * (tokens + 1280))
        combine = combine_token * (min(nvl_ranks, k) * scale_out * tokens + min(scale_out, k) * tokens
                                   + scale_out * (tokens + 1280))  # fmt: skip
    align = 2 * 1024 * 1024
    return float(-(-max(dispatch, combine) // align) * align + 14 * 1024 * 1024)


def rollout_memory(
    m: ModelSizing,
    tp: int,
    ep: int,
    sequences: int,
    seq_len: int,
    mem_fraction: float,
    gpu: str,
    capacity_gb: float,
) -> tuple[MemoryTable, float]:
    """GB an SGLang engine's GPU holds for a chunk of `sequences` sequences of up to seq_len tokens, and the share of
    them its KV pool holds at full length at once. SGLang (v0.5.17, kv_cache_configurator.py) sizes its KV pool as
    the memory left under mem_fraction_static once the weights are in: about mem_fraction x GPU - weights; a KV
    token takes kv_heads / tp (at least 1) heads of kv_elements_per_head bf16 values (MLA: one latent, every TP
    rank); a model with linear attention (Qwen3-Next) adds its DeltaNet state, a fixed size a sequence (over TP),
    for each of the chunk's sequences (SGLang's mamba pool, taken from the same budget). Weights in bf16: the
    non-expert ones split over tp, the experts over ep."""
    weights = m.engine_weight_bytes(tp, ep) / GB
    per_token = m.kv_bytes_per_token(tp)
    per_sequence = m.sequence_state_bytes(tp)
    kv = sequences * seq_len * per_token / GB
    state = sequences * per_sequence / GB
    needed = kv + state
    pool = mem_fraction * capacity_gb - weights if capacity_gb else 0.0
    rows: tuple[tuple[str, float], ...] = (
        (f"weights (bf16; non-expert / TP {tp}, experts / EP {ep})", weights),
        (f"KV cache for the chunk ({sequences:,} sequences x {seq_len:,} tokens)", kv),
    )
    if per_sequence:
        rows += ((f"{m.sequence_state} for the chunk ({sequences:,} sequences, {m.sequence_state_detail})", state),)
    held = min(1.0, pool / needed) if capacity_gb and needed else 1.0
    state_note = (f" + {per_sequence / 1e6:,.2f} MB of {m.sequence_state} a sequence ({m.sequence_state_detail}, "
                  "any length)") if per_sequence else ""  # fmt: skip
    formula = (f"SGLang's KV pool ~ mem_fraction {mem_fraction:g} x GPU - weights"
               + (f" = {pool:,.1f} GB: holds {max(held, 0):.0%} of the chunk's sequences at full length at once"
                  if capacity_gb else "") + f"; {per_token:,} bytes a token" + state_note)  # fmt: skip
    budget = f"SGLang's mem_fraction {mem_fraction:g} of the {gpu}'s {capacity_gb:,.0f} GB:"
    return MemoryTable(rows, gpu, mem_fraction * capacity_gb, formula, budget), max(held, 0.0)
