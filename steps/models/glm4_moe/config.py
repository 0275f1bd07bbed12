"""GLM-4.5 / GLM-4.6's config: its hyper-parameters under the names config.json uses (transformers'
Glm4MoeConfig, whose defaults these are), read from and written to config.json, and checked.

What moerl takes of the family, as transformers 5.23's modeling_glm4_moe.py computes it:
  - grouped-query attention with q/k/v biases (attention_bias; o_proj never has one), optional per-head q/k
    RMSNorm (use_qk_norm), rotary embedding over the first int(head_dim * partial_rotary_factor) dims of each head
    (rotate-half over that part; default RoPE only);
  - the first first_k_dense_replace layers dense (a SwiGLU MLP of intermediate_size), the rest MoE: a sigmoid
    router with a selection-only e_score_correction_bias and group-limited top-k (n_group, topk_group),
    norm_topk_prob, routed_scaling_factor, and n_shared_experts * moe_intermediate_size of shared experts.

Multi-token prediction (num_nextn_predict_layers, tensors model.layers.{num_hidden_layers}.*): moerl neither trains
nor serves those layers. config.json's num_nextn_predict_layers is accepted and ignored (transformers' own
Glm4MoeForCausalLM ignores it too, and its save_pretrained keeps the field while writing no MTP tensors), and
moerl publishes num_nextn_predict_layers = 0 because its checkpoints hold no MTP layer. A checkpoint that holds MTP
tensors (GLM-4.5's release) loads without them: state_dict_adapter.py dropped_on_import, and import_sft says how
many tensors it dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from steps.models import config_checks as checks

MODEL_TYPE = "glm4_moe"
ARCHITECTURE = "Glm4MoeForCausalLM"
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # transformers' Glm4MoeConfig default ("for BC"), and SGLang's


@dataclass
class Glm4MoeConfig:
    """GLM-4-MoE hyper-parameters, under the names config.json uses (transformers' Glm4MoeConfig; the defaults
    are its defaults). num_experts (the shared code's name) is n_routed_experts."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int = 10944  # the dense MLP of the first first_k_dense_replace layers
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads, as transformers does
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY_FACTOR
    rope_theta: float = DEFAULT_ROPE_THETA
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    use_qk_norm: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @property
    def num_experts(self) -> int:
        """The routed experts per MoE layer (the name the shared code reads)."""
        return self.n_routed_experts

    @property
    def rotary_dim(self) -> int:
        """The rotated dims of each head, as transformers' compute_default_rope_parameters and SGLang take them."""
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """As Glm4MoeDecoderLayer: the first first_k_dense_replace layers are dense, the others sparse."""
        return layer >= self.first_k_dense_replace

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers (v4 and v5) and SGLang load as Glm4MoeForCausalLM, for weights
        stored in `dtype` (SGLang's and transformers' dtype auto serve the weights in it)."""
        extra = {
            "num_nextn_predict_layers": 0,  # moerl's checkpoints hold no multi-token-prediction layer
            # v4 readers (SGLang) read rope_theta, partial_rotary_factor and rope_scaling at the top level;
            # v5 readers read rope_parameters
            "rope_scaling": None,
            "rope_parameters": {
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "rope_type": "default",
            },
        }
        return checks.hf_config_dict(self, ARCHITECTURE, MODEL_TYPE, dtype, extra)

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None:
        """(what, why) when config.json dict `d` is not a GLM-4-MoE this config can take, else None."""
        model_type = d.get("model_type")
        if model_type != MODEL_TYPE:
            return f"model_type {model_type!r}", f"GLM-4-MoE's model_type is {MODEL_TYPE!r}"
        if not d.get("n_routed_experts", d.get("num_local_experts", 128)):
            return "no experts (n_routed_experts 0)", "a dense GLM has nothing for expert parallelism"
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> Glm4MoeConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        checks.refuse(cls.refusal(d), "GLM-4-MoE", source)
        checks.refuse_quantized(d, source)
        rope_parameters = checks.default_rope_parameters(d, source)
        checks.refuse_other_activation(d, source, "GLM-4-MoE experts use silu")
        checks.refuse_attention_dropout(d, source)
        mtp = d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0))
        if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
            raise checks.unsupported(
                d, "num_nextn_predict_layers", "a count of multi-token-prediction layers, >= 0", source
            )

        required = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts_per_tok", "moe_intermediate_size",
        ]  # fmt: skip
        checks.require(d, required, "GLM-4-MoE", source)

        kwargs = checks.known_fields(cls, d)
        kwargs["n_routed_experts"] = d.get("n_routed_experts", d.get("num_local_experts", 128))
        # As transformers: rope_parameters wins over the top-level (v4) fields; then the defaults.
        for name, default in (("rope_theta", DEFAULT_ROPE_THETA),
                              ("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)):  # fmt: skip
            value = rope_parameters.get(name)
            kwargs[name] = value if value is not None else d.get(name) if d.get(name) is not None else default
        for name in checks.TOKEN_IDS:
            kwargs[name] = d.get(name)
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""
        checks.check_positive_ints(
            self,
            ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "head_dim", "n_shared_experts",
             "n_group", "topk_group"),
            source,
        )  # fmt: skip
        checks.check_top_k(self, "n_routed_experts", source)
        checks.check_kv_groups(self, source)
        dense = self.first_k_dense_replace
        if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense < self.num_hidden_layers:
            raise checks.invalid(
                source,
                f"first_k_dense_replace = {dense!r} must be in [0, num_hidden_layers={self.num_hidden_layers}) "
                "(at least one MoE layer)"
            )
        if dense and (not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            raise checks.invalid(
                source, f"the first {dense} layers are dense but intermediate_size = {self.intermediate_size!r}"
            )
        checks.check_positive_numbers(
            self, ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "partial_rotary_factor"), source
        )
        if self.partial_rotary_factor > 1:
            raise checks.invalid(source, f"partial_rotary_factor = {self.partial_rotary_factor} must be at most 1")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise checks.invalid(
                source,
                f"head_dim = {self.head_dim} x partial_rotary_factor = {self.partial_rotary_factor} gives "
                f"{self.rotary_dim} rotary dims; they must be even and at least 2"
            )
        experts, groups, chosen = self.n_routed_experts, self.n_group, self.topk_group
        if experts % groups or chosen > groups:
            raise checks.invalid(
                source, f"n_group = {groups} / topk_group = {chosen} do not split n_routed_experts = {experts}"
            )
        if groups > 1 and (experts // groups < 2 or self.num_experts_per_tok > chosen * (experts // groups)):
            raise checks.invalid(
                source,
                f"top-{self.num_experts_per_tok} of the best topk_group = {chosen} of n_group = {groups} groups of "
                f"{experts // groups} experts cannot choose enough experts (each group needs at least 2)"
            )
        checks.check_booleans(self, ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "use_qk_norm"), source)
