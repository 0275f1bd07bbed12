"""DeepSeek-V4's tensor names as the release holds them (DeepSeek's own, which SGLang 0.5.17 loads and transformers
5.23 reads through its conversion mapping): the one place they are written.

    embed.weight, norm.weight, head.weight, hc_head_{fn,base,scale}
    layers.N.{attn_norm,ffn_norm}.weight, layers.N.hc_{attn,ffn}_{fn,base,scale}
    layers.N.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}.weight, layers.N.attn.attn_sink
    layers.N.attn.compressor.{wkv,wgate,norm}.weight, .ape                      (CSA and HCA layers)
    layers.N.attn.indexer.{wq_b,weights_proj}.weight, .compressor.*             (CSA layers)
    layers.N.ffn.gate.weight, .bias (top-k layers) or .tid2eid (hash layers)
    layers.N.ffn.experts.E.{w1,w2,w3}.weight, layers.N.ffn.shared_experts.{w1,w2,w3}.weight

The model (model.py) names its modules the same under moerl's layout (model.embed_tokens, model.layers, model.norm,
lm_head, hc_head.fn) and its shared modules' names (hc_attn.fn, gate.e_score_correction_bias); to_hf and from_hf
map those. transformers' save_pretrained writes other names (it reverts its conversion only in part: attn.kv_norm
comes out as attn.norm, the experts fused): moerl reads and publishes the release's. The multi-token-prediction
module (mtp.*) is dropped on import.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from steps.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from steps.models.family import MTP_DROPPED

if TYPE_CHECKING:
    from steps.models.family import FusedExperts
    from steps.models.placement import ExpertPlacement

EXPERT_PROJECTIONS = ("w1", "w2", "w3")  # gate, down, up
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "head.weight"}  # fmt: skip
_TOP_BACK = {v: k for k, v in _TOP.items()}
_HYPER = re.compile(r"(hc_(?:attn|ffn|head))\.(fn|base|scale)$")
_HYPER_BACK = re.compile(r"(hc_(?:attn|ffn|head))_(fn|base|scale)$")
_BIAS, _BIAS_BACK = ".ffn.gate.e_score_correction_bias", ".ffn.gate.bias"


def _to_hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    name = _HYPER.sub(r"\1_\2", name.removeprefix("model."))
    return name[: -len(_BIAS)] + _BIAS_BACK if name.endswith(_BIAS) else name


def _from_hf_name(name: str) -> str:
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    name = _HYPER_BACK.sub(r"\1.\2", name)
    name = name[: -len(_BIAS_BACK)] + _BIAS if name.endswith(_BIAS_BACK) else name
    return "model." + name if name.startswith("layers.") else name


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {"w1": (intermediate, hidden), "w2": (hidden, intermediate), "w3": (intermediate, hidden)}


def compressor_shapes(hidden: int, head_dim: int, rate: int, overlap: bool) -> dict[str, tuple[int, ...]]:
    width = 2 * head_dim if overlap else head_dim
    return {"wkv.weight": (width, hidden), "wgate.weight": (width, hidden), "ape": (rate, width),
            "norm.weight": (head_dim,)}  # fmt: skip


def attention_shapes(cfg: DeepseekV4Config, layer: int) -> dict[str, tuple[int, ...]]:
    """One layer's attention tensors (names under attn.) -> shape."""
    h, heads, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "wq_a.weight": (cfg.q_lora_rank, h), "q_norm.weight": (cfg.q_lora_rank,),
        "wq_b.weight": (heads * d, cfg.q_lora_rank), "wkv.weight": (d, h), "kv_norm.weight": (d,),
        "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * d // cfg.o_groups),
        "wo_b.weight": (h, cfg.o_groups * cfg.o_lora_rank), "attn_sink": (heads,),
    }  # fmt: skip
    kind = cfg.layer_types[layer]
    if kind == SLIDING:
        return shapes
    rate = cfg.compress_rate(layer)
    for name, shape in compressor_shapes(h, d, rate, kind == CSA).items():
        shapes["compressor." + name] = shape
    if kind == CSA:
        shapes["indexer.wq_b.weight"] = (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        shapes["indexer.weights_proj.weight"] = (cfg.index_n_heads, h)
        for name, shape in compressor_shapes(h, cfg.index_head_dim, rate, True).items():
            shapes["indexer.compressor." + name] = shape
    return shapes


class DeepseekV4StateDictAdapter:
    """DeepSeek-V4 release names (steps/models/family.py StateDictAdapter)."""

    def fused_experts(self, cfg: Any) -> list[FusedExperts]:
        """None: the release holds one tensor per expert."""
        return []

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        return MTP_DROPPED if name.startswith("mtp.") else None

    def expected_shapes(
        self, cfg: DeepseekV4Config, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor of a release checkpoint of `cfg` -> shape (no MTP module); with a placement, only the routed
        experts EP rank ep_rank holds."""
        h, n = cfg.hidden_size, cfg.hc_mult
        mixes = (2 + n) * n
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.num_hidden_layers):
            p = f"layers.{layer}."
            shapes[p + "attn_norm.weight"] = (h,)
            shapes[p + "ffn_norm.weight"] = (h,)
            for block in ("attn", "ffn"):
                shapes[p + f"hc_{block}_fn"] = (mixes, n * h)
                shapes[p + f"hc_{block}_base"] = (mixes,)
                shapes[p + f"hc_{block}_scale"] = (3,)
            for name, shape in attention_shapes(cfg, layer).items():
                shapes[p + "attn." + name] = shape
            shapes[p + "ffn.gate.weight"] = (cfg.n_routed_experts, h)
            if cfg.is_hash_layer(layer):
                shapes[p + "ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
            else:
                shapes[p + "ffn.gate.bias"] = (cfg.n_routed_experts,)
            held = range(cfg.n_routed_experts) if placement is None else placement.held(layer, ep_rank)
            for e in sorted(held):
                shapes.update(self.expert_params(cfg, layer, e))
            for proj, shape in expert_shapes(h, cfg.moe_intermediate_size).items():
                shapes[p + f"ffn.shared_experts.{proj}.weight"] = shape
        shapes.update({"hc_head_fn": (n, n * h), "hc_head_base": (n,), "hc_head_scale": (1,), "norm.weight": (h,)})
        if not cfg.tie_word_embeddings:
            shapes["head.weight"] = (cfg.vocab_size, h)
        return shapes

    def expert_params(self, cfg: DeepseekV4Config, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of one routed expert's tensors (every layer is a MoE layer: moe_layer is the layer)."""
        shapes = expert_shapes(cfg.hidden_size, cfg.moe_intermediate_size)
        return [(f"layers.{moe_layer}.ffn.experts.{expert}.{proj}.weight", shapes[proj]) for proj in EXPERT_PROJECTIONS]

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_to_hf_name(name): tensor for name, tensor in state.items()}

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_from_hf_name(name): tensor for name, tensor in state.items()}
