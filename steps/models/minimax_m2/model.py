"""MiniMax-M2's layers in plain PyTorch, matching transformers 5.23's MiniMaxM2ForCausalLM: its sparse block,
attention, decoder layer and causal LM. Module names are those of the released checkpoints, which transformers'
save_pretrained writes too (`block_sparse_moe`, experts w1/w2/w3; transformers fuses the experts in memory and splits
them back on save, conversion_mapping.py "minimax_m2" -> "mixtral"), except the correction bias, which the shared
router holds as `gate.e_score_correction_bias` and the checkpoint as `block_sparse_moe.e_score_correction_bias`
(state_dict_adapter.py renames it).

Read top to bottom: the MoE block (the shared SparseMoeBlock with the sigmoid router kind: sigmoid scores of fp32
logits, the selection adding the correction bias, the top k of one group, the chosen experts' scores without the
bias renormalised, no scaling: MiniMaxM2SparseMoeBlock.route_tokens_to_experts), attention (softmax over a key/value
cache: q and k RMS-normed over the whole projection, [heads x head_dim] and [kv_heads x head_dim], before they are
cut into heads, then the first rotary_dim dims of each head rotated), the decoder layer (the shared one, its block
registered as `block_sparse_moe`) and the causal LM. The config is config.py.

Router arithmetic. transformers computes the logits in the weights' dtype and the sigmoid in fp32, and holds the
correction bias in the checkpoint's dtype; the shared router computes the logits in fp32 and keeps the bias in fp32
(kept_in_float32), as SGLang 0.5.17 does (its gate and bias are fp32: models/minimax_m2.py). In fp32 both choose the
same experts with the same weights bit for bit; in bf16 a near tie can fall the other way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import BlockSparseDecoderLayer, MoeCausalLM
from steps.models.experts import BlockSparseExpert
from steps.models.layers import RMSNorm, apply_partial_rotary, rotary_cos_sin, softmax_attention
from steps.models.minimax_m2.config import MiniMaxM2Config
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class MoeBlock(SparseMoeBlock):
    """MiniMax-M2's sparse block (MiniMaxM2SparseMoeBlock): the shared block, its sigmoid router `gate` with the
    correction bias, and experts `experts.{e}` (w1/w2/w3) for the global expert ids this rank holds."""

    expert_class = BlockSparseExpert


def moe_block(cfg: MiniMaxM2Config, slots: Sequence[int] | None = None, ep_rank: int = 0, ep_size: int = 1) -> MoeBlock:
    """A layer's sparse block: sigmoid scores, bias-corrected top num_experts_per_tok of one group, renormalised."""
    return MoeBlock(
        cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
        norm_topk_prob=True, slots=slots, ep_rank=ep_rank, ep_size=ep_size,
        router=RouterSettings(kind="sigmoid_group_topk", n_group=1, topk_group=1, routed_scaling_factor=1.0),
    )  # fmt: skip


class Attention(nn.Module):
    """Grouped-query attention as MiniMaxM2Attention: no biases, q_norm / k_norm RMSNorms over the whole q and k
    projections (one weight of heads x head_dim), partial rotary over the first rotary_dim dims of each head."""

    def __init__(self, cfg: MiniMaxM2Config, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.sliding_window = None
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, cfg.rms_norm_eps)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and rope (cos, sin [B, T, rotary_dim]) -> q [B, heads, T, D], k and v [B, kv_heads, T, D],
        q and k normed over their whole projections, then rotated over their first rotary_dim dims."""
        batch, seq, _ = x.shape
        cos, sin = rope
        # One matmul against [W_q; W_k; W_v] (the concatenation's backward hands each Parameter its rows).
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, weight).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(k).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def decoder_layer(
    cfg: MiniMaxM2Config, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> BlockSparseDecoderLayer:
    """MiniMaxM2DecoderLayer: attention, then the sparse block (every layer is sparse), as `block_sparse_moe`."""
    slots, ep_size = layer_share(cfg, placement, layer_idx)
    norms = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return BlockSparseDecoderLayer(Attention(cfg, layer_idx), moe_block(cfg, slots, ep_rank, ep_size), *norms)


class MiniMaxM2CausalLM(MoeCausalLM):
    """MiniMax-M2 causal LM (steps/models/causal_lm.py), without the multi-token-prediction layers (config.py)."""

    config: MiniMaxM2Config

    def __init__(self, config: MiniMaxM2Config, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rotary_dim]: default RoPE over the rotated dims (inv_freq = theta^(-2i/rotary_dim))."""
        assert self.config.rotary_dim is not None
        return rotary_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, dtype)
