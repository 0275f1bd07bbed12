"""DeepSeek-V3's layers in plain PyTorch, matching transformers' DeepseekV3ForCausalLM: multi-head latent
attention, the MoE block (sigmoid group-limited routing with a correction bias, plus shared experts), the dense
MLP of the first layers, and the causal LM. Module names are the checkpoint's tensor names, so the state-dict
adapter (state_dict_adapter.py) maps them one to one.

Read top to bottom: the experts and the MoE block (the shared SparseMoeBlock, router kind "sigmoid_group_topk"),
attention (MLA through the shared Attention protocol: q and k of qk_nope + qk_rope dims per head, v of v_head_dim),
the decoder layer and the causal LM (steps/models/causal_lm.py). The rotary embedding is rope.py; the torch
engine reads the modules through decode.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from steps.models.causal_lm import DecoderLayer, MoeCausalLM
from steps.models.deepseek_v3 import rope
from steps.models.deepseek_v3.config import DeepseekConfig
from steps.models.experts import SwiGLUExpert
from steps.models.layers import RMSNorm, softmax_attention
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepseekV3RMSNorm's default eps, not rms_norm_eps


class Expert(SwiGLUExpert):
    """One SwiGLU feed-forward expert, down(silu(gate(x)) * up(x)), named as DeepseekV3MLP writes it (also the
    shared experts and the dense MLP of the first first_k_dense_replace layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class MoeBlock(SparseMoeBlock):
    """DeepseekV3MoE: the shared block with DeepseekV3TopkRouter's routing (`gate.weight` and the buffer
    `gate.e_score_correction_bias`, never trained), routed experts `experts.{e}` and `shared_experts`."""

    expert_class = Expert


class Attention(nn.Module):
    """Multi-head latent attention, as DeepseekV3Attention.

    q: q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with q_lora_rank; per head [q_nope | q_rope].
    kv_a_proj_with_mqa(x) = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim, one for all heads)];
    kv_b_proj(kv_a_layernorm(latent)) = per head [k_nope | v]. k = [k_nope | k_rope] per head.
    q_rope and k_rope are rotated (in the interleaved layout when rope_interleave); the softmax scale is
    qk_head_dim ** -0.5 times YaRN's mscale squared (rope.softmax_scale)."""

    def __init__(self, cfg: DeepseekConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = None
        self.num_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = cfg.qk_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave
        self.scaling = rope.softmax_scale(cfg)
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> the queries [..., heads * qk_head_dim], before the rotation."""
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary dims x [..., rope_dim] rotated (apply_rotary_pos_emb or its interleaved form)."""
        if self.interleave:
            x = rope.deinterleave(x)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def project(
        self, x: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and (cos, sin) [B, T, rope_dim] -> q, k [B, heads, T, qk_head_dim], v [B, heads, T, v_dim]."""
        batch, seq, _ = x.shape
        cos, sin = (t.unsqueeze(1) for t in rope_tables)  # broadcast over the heads
        q = self.queries(x).view(batch, seq, self.num_heads, self.qk_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(batch, seq, self.num_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = self.rotate(k_rope.unsqueeze(1), cos, sin)  # [B, 1, T, rope_dim]: shared by the heads
        q = torch.cat([q_nope, self.rotate(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, qk_head_dim] over k/v [B, heads, S, *], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling)  # keys wider than values: the kernels take both
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.v_dim))


def decoder_layer(
    cfg: DeepseekConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> DecoderLayer:
    """DeepseekV3DecoderLayer: attention, then the MoE block (or, in the first layers, the dense MLP)."""
    mlp: nn.Module
    if cfg.is_moe_layer(layer_idx):
        slots, ep_size = layer_share(cfg, placement, layer_idx)
        router = RouterSettings("sigmoid_group_topk", cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        mlp = MoeBlock(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.norm_topk_prob, slots, ep_rank, ep_size,
            router=router, shared_intermediate_size=cfg.n_shared_experts * cfg.moe_intermediate_size,
        )  # fmt: skip
    else:
        mlp = Expert(cfg.hidden_size, cfg.intermediate_size)
    norms = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return DecoderLayer(Attention(cfg, layer_idx), mlp, *norms)


class DeepseekV3ForCausalLM(MoeCausalLM):
    """DeepSeek-V3 causal LM (steps/models/causal_lm.py). state_dict() keys are the tensor names of a Hugging
    Face DeepSeek-V3 checkpoint without its multi-token-prediction layers; e_score_correction_bias is a buffer
    (in state_dict, never among the parameters the optimizer steps)."""

    config: DeepseekConfig

    def __init__(self, config: DeepseekConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def init_extra(self, module: nn.Module) -> None:
        """As DeepseekV3PreTrainedModel: the correction bias starts at zero (init_weights' normal covers the
        router weight, a Linear here)."""
        if isinstance(module, MoeBlock):
            module.gate.e_score_correction_bias.zero_()

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.rotary_cos_sin(self.config, positions, dtype)
