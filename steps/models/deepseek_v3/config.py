"""DeepSeek-V3's config (transformers' DeepseekV3Config, also Moonlight's): its hyper-parameters under the names
config.json uses, read from and written to config.json, and checked.

What moerl does not take, and why:
  - multi-token-prediction layers (num_nextn_predict_layers; tensors model.layers.{num_hidden_layers + i}.*):
    not part of the model moerl trains, as in transformers' DeepseekV3ForCausalLM, which builds no MTP module.
    Their tensors are dropped on import (state_dict_adapter.py dropped_on_import; import_sft says how many), and
    config.json written by moerl says num_nextn_predict_layers 0 (its checkpoints hold no MTP tensors).

Kimi-K2's checkpoints say model_type "kimi_k2" with architectures DeepseekV3ForCausalLM (its own modeling code is
DeepSeek-V3's): they load as this family, and the model_type is written back as the checkpoint had it.
  - quantization_config (DeepSeek-V3's published fp8 weights with per-block scales): refused; dequantize to
    bf16 first (DeepSeek's inference/fp8_cast_bf16.py, or transformers' from_pretrained + save_pretrained).
  - rope types other than default and yarn; num_key_value_heads != num_attention_heads (multi-head latent
    attention makes one key and value per head); hidden_act other than silu; scoring_func, topk_method and
    moe_layer_freq other than DeepSeek-V3's (sigmoid, noaux_tc, 1: what transformers computes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from steps.errors import MoerlError
from steps.models import config_checks as checks

MODEL_TYPE = "deepseek_v3"
MODEL_TYPES = (MODEL_TYPE, "kimi_k2")  # Kimi-K2: DeepSeek-V3's architecture under a model_type of its own
ARCHITECTURE = "DeepseekV3ForCausalLM"
YARN_KEYS = (
    "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "attention_factor", "truncate",
)  # fmt: skip


@dataclass
class DeepseekConfig:
    """DeepSeek-V3 hyper-parameters, under the names config.json uses (DeepseekV3Config), with its defaults.

    rope_scaling: None for default RoPE, else the YaRN parameters (YARN_KEYS that config.json gives, with
    rope_type "yarn"), read from rope_scaling (v4 configs) or rope_parameters (v5 configs)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    num_key_value_heads: int | None = None  # None -> num_attention_heads, as transformers
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    model_type: str = MODEL_TYPE  # as the checkpoint says it (MODEL_TYPES), written back unchanged
    family_name: ClassVar[str] = "DeepSeek-V3"  # as errors name it (DeepSeek-V3.2's config extends this one)
    architecture: ClassVar[str] = ARCHITECTURE  # transformers' class, as errors name it

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    @property
    def num_experts(self) -> int:
        """The routed experts (the name the shared code reads, FamilyConfig)."""
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        """Per head: the queries' and keys' size (the values' is v_head_dim)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """As DeepseekV3DecoderLayer: the first first_k_dense_replace layers are dense, the rest sparse."""
        return layer >= self.first_k_dense_replace

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers (v4 and v5) and SGLang load as DeepseekV3ForCausalLM, for
        weights stored in `dtype`. No MTP layers (num_nextn_predict_layers 0: the checkpoint holds none)."""
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            # v4 readers (SGLang) read rope_theta + rope_scaling (type or rope_type); v5 reads rope_scaling first
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta, "rope_type": "yarn", "type": "yarn"}
        extra = {
            "rope_scaling": rope if self.rope_scaling is not None else None,
            "rope_parameters": rope,
            "qk_head_dim": self.qk_head_dim,
            "head_dim": self.qk_rope_head_dim,  # as DeepseekV3Config: the rotary dims
            "num_nextn_predict_layers": 0,
            "scoring_func": "sigmoid",  # DeepSeek's own modeling code and SGLang read these three
            "topk_method": "noaux_tc",
            "moe_layer_freq": 1,
        }
        return checks.hf_config_dict(self, ARCHITECTURE, None, dtype, extra)  # model_type: a field

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a DeepSeek-V3 this config can take, else None."""
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            return f"model_type {model_type!r}", f"DeepSeek-V3's model_type is one of {list(MODEL_TYPES)}"
        if not d.get("n_routed_experts", d.get("num_local_experts", 256)):
            return "no experts (n_routed_experts 0)", "a dense model has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> DeepseekConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), cls.family_name, source)
        checks.refuse_quantized(
            d,
            source,
            "dequantize the fp8 weights to bf16 first, e.g. DeepSeek's inference/fp8_cast_bf16.py, and drop "
            "quantization_config",
        )
        checks.refuse_other_activation(d, source, f"{cls.family_name}'s experts use silu")
        checks.refuse_attention_dropout(d, source)
        for name, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
            if d.get(name, value) != value:
                raise checks.unsupported(
                    d, name, f"transformers' {cls.architecture} computes {name} {value!r} only", source
                )
        heads = d.get("num_attention_heads")
        if d.get("num_key_value_heads") not in (None, heads):
            raise checks.unsupported(
                d,
                "num_key_value_heads",
                f"multi-head latent attention has one key and value per head; set it to num_attention_heads ({heads})",
                source,
            )
        rope_theta, rope_scaling = _rope(d, source, cls.family_name)

        required = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
            "moe_intermediate_size", "intermediate_size",
        ]  # fmt: skip
        checks.require(d, required, cls.family_name, source)

        kwargs = checks.known_fields(cls, d)
        kwargs["n_routed_experts"] = d.get("n_routed_experts", d.get("num_local_experts", 256))
        defaults = cls.__dataclass_fields__  # the class's own (an extending family's differ)
        kwargs["q_lora_rank"] = d.get("q_lora_rank", defaults["q_lora_rank"].default)  # None is meaningful: q_proj
        kwargs["rope_theta"], kwargs["rope_scaling"] = rope_theta, rope_scaling
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs[name] = d.get(name, defaults[name].default)  # the config class's defaults when absent
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "n_routed_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "kv_lora_rank",
                    "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group"]  # fmt: skip
        if self.q_lora_rank is not None:
            positive.append("q_lora_rank")
        if self.first_k_dense_replace > 0:
            positive.append("intermediate_size")
        checks.check_positive_ints(self, positive, source)
        if self.num_key_value_heads != self.num_attention_heads:
            raise checks.invalid(
                source, f"num_key_value_heads = {self.num_key_value_heads} must equal num_attention_heads"
            )
        checks.check_top_k(self, "n_routed_experts", source)
        checks.check_rotary_dim(self, "qk_rope_head_dim", source)
        group_size = self.n_routed_experts // self.n_group
        if self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise checks.invalid(
                source,
                f"n_group = {self.n_group} / topk_group = {self.topk_group} do not split n_routed_experts = "
                f"{self.n_routed_experts} into groups"
            )
        if group_size < 2 or self.num_experts_per_tok > self.topk_group * group_size:
            raise checks.invalid(
                source,
                f"group-limited routing of num_experts_per_tok = {self.num_experts_per_tok} from topk_group = "
                f"{self.topk_group} groups of {group_size} experts (the router scores each group by its best two)"
            )
        first = self.first_k_dense_replace
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < self.num_hidden_layers:
            raise checks.invalid(
                source, f"first_k_dense_replace = {first!r} must be in [0, num_hidden_layers) (some MoE layer)"
            )
        checks.check_positive_numbers(self, ("rms_norm_eps", "rope_theta", "routed_scaling_factor"), source)
        checks.check_booleans(
            self, ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "rope_interleave"), source
        )
        checks.check_yarn_factor(self.rope_scaling, source)


def _rope(d: dict[str, Any], source: str, family: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, the YaRN parameters or None) of a config.json dict, as transformers v5 reads them:
    rope_scaling wins over rope_parameters; rope_theta inside them over the top-level one."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise MoerlError(f"{source}: rope_scaling / rope_parameters = {params!r} must be an object; fix config.json")
    theta = params.get("rope_theta", d.get("rope_theta")) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise MoerlError(
            f"{source}: rope type {rope_type!r} is not supported by moerl ({family}: default or yarn RoPE)"
        )
    yarn = {k: params[k] for k in YARN_KEYS if params.get(k) is not None}
    # transformers' standardize_rope_params: a top-level original_max_position_embeddings wins, else the
    # rope dict's, else max_position_embeddings
    original = d.get("original_max_position_embeddings") or yarn.get("original_max_position_embeddings")
    yarn["original_max_position_embeddings"] = original or d.get("max_position_embeddings", 4096)
    return theta, yarn
