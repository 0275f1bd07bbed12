"""Mixtral's layers in plain PyTorch, matching transformers' MixtralForCausalLM: its experts and sparse block,
attention, decoder layer and causal LM. Module names are the tensor names of Mixtral's published checkpoints
(`block_sparse_moe`, experts `w1`/`w2`/`w3`), which is also what transformers 5.23's save_pretrained writes (it
fuses the experts in memory and splits them back on save, transformers/conversion_mapping.py "mixtral"), so the
state-dict adapter (state_dict_adapter.py) maps them one to one.

Read top to bottom: the experts and the MoE block (the shared SparseMoeBlock, softmax top-k router with the top-k
weights renormalised), attention (the shared softmax_kv_cache kind: grouped-query, no biases, no q/k norms,
default RoPE, an optional sliding window), the decoder layer (the shared one, its MoE block registered under the
checkpoint's name) and the causal LM (the shared skeleton, steps/models/causal_lm.py). The config is config.py.

Router arithmetic. MixtralTopKRouter takes softmax(logits.float()), the top k, and divides them by their sum in
place; the shared block with norm_topk_prob=True does the same ops in fp32, so in fp32 the weights are the same
bits. transformers keeps the weights in fp32 and multiplies the experts' outputs by them in fp32 before casting
back; the shared block casts the weights to the hidden dtype first, so in bf16 the combine rounds differently: the
weights differ by one bf16 rounding (at most 2**-9 relative), and on 4096 random tokens the bf16 block outputs
differed by 0.006 on average (outputs 4.2 on average), a third of either's own bf16 error against fp32 (0.02).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import BlockSparseDecoderLayer, MoeCausalLM
from steps.models.experts import BlockSparseExpert
from steps.models.layers import RMSNorm, rotary_cos_sin, softmax_attention
from steps.models.mixtral.config import MixtralConfig
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class MoeBlock(SparseMoeBlock):
    """Mixtral's sparse block (MixtralSparseMoeBlock): the shared block, its softmax top-k router `gate` with the
    top-k weights renormalised, and experts `experts.{e}` (w1/w2/w3: BlockSparseExpert) for the global expert ids
    this rank holds."""

    expert_class = BlockSparseExpert


def moe_block(cfg: MixtralConfig, slots: Sequence[int] | None = None, ep_rank: int = 0, ep_size: int = 1) -> MoeBlock:
    """A layer's MixtralSparseMoeBlock: softmax over the experts, top num_experts_per_tok, renormalised."""
    return MoeBlock(
        cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
        norm_topk_prob=True, slots=slots, ep_rank=ep_rank, ep_size=ep_size,
        router=RouterSettings(kind="softmax_topk"),
    )  # fmt: skip


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention without biases or q/k norms, default RoPE, and config.json's sliding window
    (None: every earlier key), as MixtralAttention."""

    def __init__(self, cfg: MixtralConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.sliding_window = cfg.sliding_window  # the shared masks apply it (steps/models/layers.py)
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and rope (cos, sin) [B, T, D] -> q [B, heads, T, D], k and v [B, kv_heads, T, D], q and k
        rotated (apply_rotary_pos_emb's rotate-half form)."""
        batch, seq, _ = x.shape
        # One matmul against [W_q; W_k; W_v] (the concatenation's backward hands each Parameter its rows).
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, weight).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def decoder_layer(
    cfg: MixtralConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> BlockSparseDecoderLayer:
    """MixtralDecoderLayer: attention, then the sparse block (every layer is sparse), registered as
    `block_sparse_moe`."""
    slots, ep_size = layer_share(cfg, placement, layer_idx)
    norms = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return BlockSparseDecoderLayer(Attention(cfg, layer_idx), moe_block(cfg, slots, ep_rank, ep_size), *norms)


class MixtralCausalLM(MoeCausalLM):
    """Mixtral causal LM (steps/models/causal_lm.py). state_dict() keys are the tensor names of a Hugging Face
    Mixtral checkpoint."""

    config: MixtralConfig

    def __init__(self, config: MixtralConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: RMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.config.head_dim is not None
        return rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)
