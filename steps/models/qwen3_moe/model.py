"""Qwen3-MoE's layers in plain PyTorch, matching transformers' Qwen3MoeForCausalLM: its experts (Qwen3MoeMLP) and
sparse block, attention, decoder layer and causal LM. Module names are the checkpoint's tensor names, so the
state-dict adapter (state_dict_adapter.py) maps them one to one.

Read top to bottom: the experts and the MoE block (the shared SparseMoeBlock with this family's experts), attention
(the shared softmax_kv_cache kind with q/k RMSNorm), the decoder and the causal LM (training and scoring; the
rollout engine decodes with its own prefill and key/value tree, steps/engines/torch_engine.py, reading the modules
through decode.py). The config is config.py; the shared components are in steps/models/ (moe.py, layers.py,
kernels.py, placement.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.kernels import QKVHeads
from steps.models.layers import RMSNorm, attention_mask_for, rotary_cos_sin, softmax_attention
from steps.models.moe import SparseMoeBlock, SwiGLUExpert
from steps.models.placement import check_placement, moe_layer_indices
from steps.models.qwen3_moe.config import MoeConfig

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Expert(SwiGLUExpert):
    """One SwiGLU feed-forward expert, down(silu(gate(x)) * up(x)), named as Qwen3MoeMLP writes it (also the dense
    MLP of the layers that are not sparse)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class MoeBlock(SparseMoeBlock):
    """Qwen3-MoE's sparse block (Qwen3MoeSparseMoeBlock): the shared block, its softmax top-k router `gate` and
    Qwen3MoeMLP experts `experts.{e}` for the global expert ids this rank holds."""

    expert_class = Expert


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (before RoPE), as Qwen3MoeAttention."""

    def __init__(self, cfg: MoeConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.attend(q, k, v, mask)

    def forward_shared_prompts(
        self,
        prompt_x: torch.Tensor,
        response_x: torch.Tensor,
        prompt_rope: tuple[torch.Tensor, torch.Tensor],
        response_rope: tuple[torch.Tensor, torch.Tensor],
        prompt_mask: torch.Tensor,
        response_mask: torch.Tensor,
        prompt_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts [G, P, H] attend among themselves; responses [R, T, H] attend to the k/v of their prompt
        (row prompt_index[r]) followed by their own. Masks as MoeForCausalLM.forward_shared_prompts builds them."""
        qp, kp, vp = self.project(prompt_x, *prompt_rope)
        qr, kr, vr = self.project(response_x, *response_rope)
        # index_select: each response reads its prompt's k/v; the backward sums the responses' gradients
        k = torch.cat([kp.index_select(0, prompt_index), kr], dim=2)
        v = torch.cat([vp.index_select(0, prompt_index), vr], dim=2)
        return self.attend(qp, kp, vp, prompt_mask), self.attend(qr, k, v, response_mask)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, heads, T, D], k and v [B, kv_heads, T, D], q and k normed and rotated."""
        # One matmul against [W_q; W_k; W_v] (the concatenation's backward hands each Parameter its rows).
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
        return QKVHeads.apply(
            F.linear(x, weight, bias), self.q_norm.weight, self.k_norm.weight, cos, sin,
            self.num_heads, self.num_kv_heads, self.q_norm.eps,
        )  # fmt: skip

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: MoeConfig,
        layer_idx: int,
        placement: ExpertPlacement | None = None,
        ep_rank: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp: nn.Module
        if cfg.is_moe_layer(layer_idx):
            slots, ep_size = None, 1
            if placement is not None:
                slots, ep_size = placement.slots[moe_layer_indices(cfg).index(layer_idx)], placement.ep_size
            self.mlp = MoeBlock(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                slots,
                ep_rank,
                ep_size,
            )
        else:
            self.mlp = Expert(cfg.hidden_size, cfg.intermediate_size)  # Qwen3MoeMLP: the same SwiGLU block
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_shared_prompts(
        self,
        prompt_x: torch.Tensor,
        response_x: torch.Tensor,
        prompt_rope: tuple[torch.Tensor, torch.Tensor],
        response_rope: tuple[torch.Tensor, torch.Tensor],
        prompt_mask: torch.Tensor,
        response_mask: torch.Tensor,
        prompt_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on prompts [G, P, H] and responses [R, T, H]: see Attention.forward_shared_prompts."""
        attn_prompt, attn_response = self.self_attn.forward_shared_prompts(
            self.input_layernorm(prompt_x), self.input_layernorm(response_x), prompt_rope, response_rope,
            prompt_mask, response_mask, prompt_index,
        )  # fmt: skip
        prompt_x, response_x = prompt_x + attn_prompt, response_x + attn_response
        # One MLP call over the prompt and the response tokens: an MoE layer routes and exchanges them in a
        # single dispatch, exactly once per layer as in forward (every EP rank must make the same calls).
        hidden = prompt_x.shape[-1]
        tokens = torch.cat([prompt_x.reshape(-1, hidden), response_x.reshape(-1, hidden)])
        out = self.mlp(self.post_attention_layernorm(tokens))
        num_prompt = prompt_x.shape[0] * prompt_x.shape[1]
        return prompt_x + out[:num_prompt].view_as(prompt_x), response_x + out[num_prompt:].view_as(response_x)


class MoeModel(nn.Module):
    """The decoder stack; its attribute names give the `model.` prefix of the checkpoint tensor names."""

    def __init__(self, cfg: MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, layer, placement, ep_rank) for layer in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoeForCausalLM(nn.Module):
    """Qwen3-MoE causal LM. state_dict() keys are the tensor names of a Hugging Face Qwen3-MoE checkpoint.

    placement (steps.models.placement.ExpertPlacement) and ep_rank build the model of one expert-parallel
    rank: in every MoE layer only the experts the placement gives that rank (placement.held(layer, ep_rank));
    their names keep the global index, so its state_dict is a subset of the full one. Without a placement
    the model holds every expert.
    """

    def __init__(self, config: MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__()
        config.validate()
        check_placement(config, placement, ep_rank)
        self.config = config
        self.placement = placement
        self.ep_rank = ep_rank
        self.model = MoeModel(config, placement, ep_rank)
        # Tied: logits use the embedding matrix and no lm_head.weight exists (save_pretrained omits it too).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """As transformers: normal(0, initializer_range) for linear/embedding/router, ones for norms."""
        if self.model.norm.weight.is_meta:
            return  # built on the meta device to receive loaded weights: nothing to initialise
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def moe_blocks(self) -> list[MoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoeBlock)]

    def set_dispatch(self, dispatch: object) -> None:
        """Use `dispatch` (an ExpertDispatch) for the experts of every MoE layer."""
        for block in self.moe_blocks():
            block.dispatch = dispatch  # type: ignore[assignment]

    def count_routed_rows(self) -> None:
        """Start (or restart) counting, per MoE layer and global expert id, the (token, expert) rows this
        process's forward passes route (see routed_rows)."""
        for block in self.moe_blocks():
            block.routed_rows = torch.zeros(block.num_experts, dtype=torch.int64, device=block.gate.weight.device)

    def routed_rows(self) -> torch.Tensor:
        """[num MoE layers, num_experts] int64: the rows counted since count_routed_rows (this process's
        tokens only: sum over the ranks for the global loads)."""
        counts = [block.routed_rows for block in self.moe_blocks()]
        if any(c is None for c in counts):
            raise RuntimeError("routed_rows: call count_routed_rows() before the forward passes")
        return torch.stack(counts)  # type: ignore[arg-type]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] in float32 (training and scoring: the rollout engine decodes
        with its own prefill and key/value tree, steps/engines/torch_engine.py).

        attention_mask [B, T] marks the real tokens (1) and the padding (0); prompts are left-padded, and
        positions count real tokens only.
        """
        batch, seq = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            new_valid = torch.ones(batch, seq, dtype=torch.bool, device=device)
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {(batch, seq)}"
                )
            new_valid = attention_mask.to(torch.bool)

        # Left padding: a row's first real token gets position 0; padding gets 0 too (it is masked anyway).
        positions = (new_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        mask = attention_mask_for(new_valid, 0, seq)

        x = self.model.embed_tokens(input_ids)
        assert self.config.head_dim is not None
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()

    def forward_shared_prompts(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        prompt_index: torch.Tensor,
    ) -> torch.Tensor:
        """Training forward for GRPO groups: each prompt runs once, its responses attend to its keys/values.

        prompt_ids, prompt_mask [G, P]: the distinct prompts, LEFT-padded (every row's last column is its last
        real token). response_ids, response_mask [R, T]: the tokens fed after the prompt, RIGHT-padded; for
        training these are each response without its last token (T may be 0). prompt_index [R]: the prompt
        row of each response.

        Returns logits [R, T + 1, V] (float32): slot 0 is the prompt's last position (it predicts the
        response's first token), slot t >= 1 is response position t - 1. For the same token sequences every
        logit, hence every log-prob and gradient, is the one `forward` computes over prompt + response: the
        same positions (a response continues after its prompt's real tokens), the same keys (the prompt's,
        then the response's own, causally), the same per-token norms, MLPs and experts. Prompt and response
        tokens go through each MoE layer in one call, so the expert dispatch is the same as forward's.
        """
        if prompt_ids.shape != prompt_mask.shape or response_ids.shape != response_mask.shape:
            raise ValueError("prompt_mask/response_mask must have the shapes of prompt_ids/response_ids")
        if prompt_index.shape != response_ids.shape[:1]:
            raise ValueError(f"prompt_index has shape {tuple(prompt_index.shape)}, expected ({response_ids.shape[0]},)")
        prompt_valid, response_valid = prompt_mask.to(torch.bool), response_mask.to(torch.bool)
        if not bool(prompt_valid[:, -1].all()):
            raise ValueError("forward_shared_prompts needs left-padded prompts (a real last token in every row)")
        prompt_index = prompt_index.to(device=prompt_ids.device, dtype=torch.long)
        prompt_len = prompt_ids.shape[1]
        response_len = response_ids.shape[1]

        # Positions as forward counts them: real tokens from 0; a response continues after its prompt.
        prompt_positions = (prompt_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        prompt_lengths = prompt_valid.long().sum(dim=1).index_select(0, prompt_index)
        response_positions = prompt_lengths[:, None] + (response_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        prompt_attn = attention_mask_for(prompt_valid, 0, prompt_len)  # [G, 1, P, P]
        # A response query sees its prompt's real tokens, then its own tokens causally ([R, 1, T, P + T]).
        sees_prompt = prompt_valid.index_select(0, prompt_index)[:, None, None, :]
        sees_prompt = sees_prompt.expand(-1, 1, response_len, prompt_len)
        response_attn = torch.cat([sees_prompt, attention_mask_for(response_valid, 0, response_len)], dim=-1)

        prompt_x = self.model.embed_tokens(prompt_ids)
        response_x = self.model.embed_tokens(response_ids)
        assert self.config.head_dim is not None
        prompt_rope = rotary_cos_sin(prompt_positions, self.config.head_dim, self.config.rope_theta, prompt_x.dtype)
        response_rope = rotary_cos_sin(
            response_positions, self.config.head_dim, self.config.rope_theta, response_x.dtype
        )
        for layer in self.model.layers:
            prompt_x, response_x = layer.forward_shared_prompts(
                prompt_x, response_x, prompt_rope, response_rope, prompt_attn, response_attn, prompt_index
            )
        # Only the prompts' last positions are needed from the prompts: norm and lm_head run per token.
        last = prompt_x[:, -1:].index_select(0, prompt_index)  # [R, 1, H]
        x = self.model.norm(torch.cat([last, response_x], dim=1))
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()
