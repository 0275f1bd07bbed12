"""DeepSeek-V4's config: its hyper-parameters under the names config.json uses (transformers 5.23's DeepseekV4Config),
read from and written to config.json, and checked.

Read as transformers reads it: the per-layer `layer_types` (sliding_attention, compressed_sparse_attention,
heavily_compressed_attention) and `mlp_layer_types` (hash_moe, moe), or the release's legacy keys
(`compress_ratios` per layer: 0 sliding, 4 CSA, 128 HCA; `num_hash_layers`; `compress_rate_csa` /
`compress_rate_hca`; `qk_rope_head_dim`), and the two rotaries: "main" (rope_theta, default RoPE) for the sliding
layers, "compress" (compress_rope_theta, optionally YaRN from rope_scaling, its attention factor 1) for the
compressed layers, their compressors and indexers. Written with both sets of keys (SGLang and DeepSeek's own code
read the legacy ones).

Refused with one line naming the field and the fix: quantized weights (the release's FP8/FP4 experts: convert to
bf16 first), scoring_func other than sqrtsoftplus, num_key_value_heads other than 1 (one shared key=value head),
n_shared_experts other than 1 (transformers builds one shared expert of moe_intermediate_size), norm_topk_prob
false (transformers' router renormalises always), a rope type other than default or yarn, attention or MLP
biases, hidden_act other than silu, attention dropout. The multi-token-prediction layers (num_nextn_predict_layers;
tensors mtp.*) are dropped on import, as transformers drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models import config_checks as checks

MODEL_TYPE = "deepseek_v4"
ARCHITECTURE = "DeepseekV4ForCausalLM"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
LEGACY_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' _COMPRESS_RATIO_TO_LAYER_TYPE
DEFAULT_HASH_LAYERS = 3
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate")  # fmt: skip
QUANTIZED_FIX = (
    "moerl reads float weights; convert the release's FP8/FP4 weights to bf16 first (transformers: "
    "DeepseekV4ForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16).save_pretrained(OUT_DIR) dequantizes), and drop "
    "quantization_config"
)


@dataclass
class DeepseekV4Config:
    """DeepSeek-V4 hyper-parameters under config.json's names (DeepseekV4Config), with its defaults. Every layer is
    sparse (a hash-routed or a top-k routed MoE block with one shared expert)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = None  # the compress rotary's YaRN parameters; None: default RoPE
    layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_COMPRESS_RATES))
    mlp_layer_types: list[str] = field(default_factory=list)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None

    @property
    def num_experts(self) -> int:
        """The routed experts (the name the shared code reads, FamilyConfig)."""
        return self.n_routed_experts

    def is_moe_layer(self, layer: int) -> bool:
        """Every DeepSeek-V4 decoder layer is sparse."""
        return 0 <= layer < self.num_hidden_layers

    def is_hash_layer(self, layer: int) -> bool:
        """Whether layer `layer` routes by its fixed token-to-experts table (mlp_layer_types hash_moe)."""
        return self.mlp_layer_types[layer] == "hash_moe"

    def compress_rate(self, layer: int) -> int:
        """The tokens a compressed entry of layer `layer` pools (its layer type's rate)."""
        return self.compress_rates[self.layer_types[layer]]

    @property
    def partial_rotary_factor(self) -> float:
        return self.qk_rope_head_dim / self.head_dim

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json that transformers loads as DeepseekV4ForCausalLM (its keys) and SGLang / DeepSeek's code read
        (the legacy compress_ratios, num_hash_layers and qk_rope_head_dim), for weights stored in `dtype`. No
        multi-token-prediction layers (the checkpoint holds none)."""
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor}  # fmt: skip
        if self.rope_scaling is not None:
            compress = {**self.rope_scaling, **compress, "rope_type": "yarn", "attention_factor": 1.0}
        main = {"rope_type": "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor}  # fmt: skip
        hashed = [t == "hash_moe" for t in self.mlp_layer_types]
        prefix = 0  # the leading hash layers
        while prefix < len(hashed) and hashed[prefix]:
            prefix += 1
        extra: dict[str, Any] = {
            "rope_parameters": {"main": main, "compress": compress},
            # the release's flat YaRN of the compress rotary (DeepSeek's code and SGLang read it; transformers folds
            # it into rope_parameters the same way)
            "rope_scaling": None
            if self.rope_scaling is None
            else {**self.rope_scaling, "type": "yarn", "rope_type": "yarn"},
            "partial_rotary_factor": self.partial_rotary_factor,
            "compress_ratios": [0 if t == SLIDING else self.compress_rates[t] for t in self.layer_types],
            "num_nextn_predict_layers": 0,
            "attention_bias": False,
            "mlp_bias": False,
        }
        if not any(hashed[prefix:]):  # SGLang reads the hash layers as the first num_hash_layers
            extra["num_hash_layers"] = prefix
        return checks.hf_config_dict(self, ARCHITECTURE, MODEL_TYPE, dtype, extra)

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a DeepSeek-V4 this config can take, else None."""
        if d.get("model_type") != MODEL_TYPE:
            return f"model_type {d.get('model_type')!r}", f"DeepSeek-V4's model_type is {MODEL_TYPE!r}"
        if not d.get("n_routed_experts", d.get("num_local_experts", 256)):
            return "no experts (n_routed_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> DeepseekV4Config:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), "DeepSeek-V4", source)
        checks.refuse_quantized(d, source, QUANTIZED_FIX)
        checks.refuse_other_activation(d, source, "DeepSeek-V4's experts use silu")
        checks.refuse_attention_dropout(d, source)
        for name, value, why in (
            ("scoring_func", "sqrtsoftplus", "DeepSeek-V4's router scores sqrt(softplus(logits))"),
            ("num_key_value_heads", 1, "DeepSeek-V4 has one shared key=value head"),
            ("n_shared_experts", 1, "transformers' DeepseekV4SparseMoeBlock builds one shared expert"),
            ("norm_topk_prob", True, "transformers' DeepSeek-V4 router always renormalises the chosen weights"),
            ("attention_bias", False, "DeepSeek-V4's projections have no biases"),
            ("mlp_bias", False, "DeepSeek-V4's experts have no biases"),
        ):
            if d.get(name, value) != value:
                raise checks.unsupported(d, name, why, source)
        required = ["vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_experts_per_tok"]  # fmt: skip
        checks.require(d, required, "DeepSeek-V4", source)
        kwargs = checks.known_fields(cls, d)
        kwargs["n_routed_experts"] = d.get("n_routed_experts", d.get("num_local_experts", 256))
        defaults = cls.__dataclass_fields__
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs[name] = d.get(name, defaults[name].default)
        layers = d["num_hidden_layers"]
        kwargs["compress_rates"] = _compress_rates(d, source)
        kwargs["layer_types"] = _layer_types(d, layers, source)
        kwargs["mlp_layer_types"] = _mlp_layer_types(d, layers, source)
        head_dim = d.get("head_dim") or defaults["head_dim"].default
        kwargs["qk_rope_head_dim"] = _rope_dims(d, head_dim, source)
        kwargs["rope_theta"], kwargs["compress_rope_theta"], kwargs["rope_scaling"] = _rotaries(d, source)
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""
        positive = ["vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "n_routed_experts", "num_experts_per_tok", "head_dim", "q_lora_rank", "qk_rope_head_dim",
                    "hc_mult", "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads",
                    "index_head_dim", "index_topk"]  # fmt: skip
        checks.check_positive_ints(self, positive, source)
        checks.check_top_k(self, "n_routed_experts", source)
        checks.check_positive_numbers(
            self, ("rms_norm_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit",
                   "hc_eps"), source)  # fmt: skip
        checks.check_booleans(self, ("tie_word_embeddings", "norm_topk_prob"), source)
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise checks.invalid(
                source,
                f"qk_rope_head_dim = {self.qk_rope_head_dim} (head_dim x partial_rotary_factor) must be even and at "
                f"most head_dim ({self.head_dim}) and index_head_dim ({self.index_head_dim})",
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise checks.invalid(
                source, f"o_groups = {self.o_groups} must divide num_attention_heads x head_dim "
                f"({self.num_attention_heads * self.head_dim})"
            )  # fmt: skip
        for kind in (CSA, HCA):
            rate = self.compress_rates.get(kind)
            if not checks.is_positive_int(rate) or (kind == CSA and rate < 1):
                raise checks.invalid(source, f"compress_rates[{kind!r}] = {rate!r} must be a positive integer")
        checks.check_yarn_factor(self.rope_scaling, source)


def _compress_rates(d: dict[str, Any], source: str) -> dict[str, int]:
    """compress_rates, with the legacy compress_rate_csa / compress_rate_hca folded in (as transformers does)."""
    rates = d.get("compress_rates") or dict(DEFAULT_COMPRESS_RATES)
    if not isinstance(rates, dict) or set(rates) - {CSA, HCA}:
        raise MoerlError(f"{source}: compress_rates = {rates!r} must map {CSA!r} and {HCA!r} to rates; fix config.json")
    rates = {**DEFAULT_COMPRESS_RATES, **rates}
    for key, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if d.get(key) is not None:
            rates[kind] = d[key]
    return rates


def _layer_types(d: dict[str, Any], layers: int, source: str) -> list[str]:
    """layer_types, else the legacy per-layer compress_ratios, else transformers' default (2 HCA, then CSA / HCA
    alternating)."""
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        ratios = d["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in LEGACY_RATIOS for r in ratios):
            raise MoerlError(
                f"{source}: compress_ratios = {ratios!r} must list 0, 4 or 128 per layer (or give layer_types); "
                "fix config.json"
            )
        types = [LEGACY_RATIOS[r] for r in ratios]
    if types is None:
        types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    return _per_layer("layer_types", types, LAYER_TYPES, layers, source)


def _mlp_layer_types(d: dict[str, Any], layers: int, source: str) -> list[str]:
    """mlp_layer_types, else num_hash_layers (legacy) hash-routed layers first, the rest top-k routed."""
    types = d.get("mlp_layer_types")
    if types is None:
        hashed = d.get("num_hash_layers", DEFAULT_HASH_LAYERS)
        if not isinstance(hashed, int) or isinstance(hashed, bool) or hashed < 0:
            raise MoerlError(f"{source}: num_hash_layers = {hashed!r} must be an integer >= 0; fix config.json")
        types = ["hash_moe"] * min(layers, hashed) + ["moe"] * max(0, layers - hashed)
    return _per_layer("mlp_layer_types", types, MLP_LAYER_TYPES, layers, source)


def _per_layer(name: str, types: Any, allowed: tuple[str, ...], layers: int, source: str) -> list[str]:
    """A per-layer list of kinds, cut to num_hidden_layers as transformers cuts it; refused unless it gives one of
    `allowed` for every layer."""
    types = list(types)[:layers] if isinstance(types, list | tuple) else types
    if not isinstance(types, list) or len(types) != layers or any(t not in allowed for t in types):
        raise MoerlError(
            f"{source}: {name} = {types!r} must give one of {list(allowed)} for each of the num_hidden_layers = "
            f"{layers} layers; fix config.json"
        )
    return types


def _rope_dims(d: dict[str, Any], head_dim: int, source: str) -> int:
    """The rotary dims: head_dim x partial_rotary_factor (the nested rope_parameters' or the top-level one), else
    the legacy qk_rope_head_dim, else transformers' default 64 / 512 of head_dim."""
    factor = d.get("partial_rotary_factor")
    nested = d.get("rope_parameters")
    if factor is None and isinstance(nested, dict) and isinstance(nested.get("main"), dict):
        factor = nested["main"].get("partial_rotary_factor")
    if factor is None:
        if d.get("qk_rope_head_dim") is not None:
            return int(d["qk_rope_head_dim"])
        factor = 64 / 512
    if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise MoerlError(f"{source}: partial_rotary_factor = {factor!r} must be in (0, 1]; fix config.json")
    return int(head_dim * factor)


def _rotaries(d: dict[str, Any], source: str) -> tuple[float, float, dict[str, Any] | None]:
    """(rope_theta, compress_rope_theta, the compress rotary's YaRN parameters or None), from the nested
    rope_parameters {"main": ..., "compress": ...} transformers writes, or the flat rope_scaling / rope_parameters
    of the release (YaRN there is the compress rotary's; the main one is always default RoPE)."""
    main_theta, compress_theta = d.get("rope_theta") or 10000.0, d.get("compress_rope_theta") or 160000.0
    nested = d.get("rope_parameters")
    if isinstance(nested, dict) and isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        main, compress = nested["main"], nested["compress"]
        if checks.rope_type(main) != "default":
            raise MoerlError(f"{source}: rope_parameters.main.rope_type {checks.rope_type(main)!r} is not supported "
                             "by moerl (DeepSeek-V4's main rotary is default RoPE); fix config.json")  # fmt: skip
        main_theta = main.get("rope_theta", main_theta)
        compress_theta = compress.get("rope_theta", compress_theta)
        params = compress
    else:
        params = d.get("rope_scaling") or nested or {}
    if not isinstance(params, dict):
        raise MoerlError(f"{source}: rope_scaling / rope_parameters = {params!r} must be an object; fix config.json")
    kind = checks.rope_type(params)
    if kind == "default":
        return main_theta, compress_theta, None
    if kind != "yarn":
        raise MoerlError(f"{source}: rope type {kind!r} is not supported by moerl (DeepSeek-V4: default or yarn)")
    yarn = {k: params[k] for k in YARN_KEYS if params.get(k) is not None}
    if yarn.get("original_max_position_embeddings") is None:
        yarn["original_max_position_embeddings"] = d.get("max_position_embeddings", 1048576)
    return main_theta, compress_theta, yarn
