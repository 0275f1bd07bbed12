"""Qwen3-Next's layers in plain PyTorch, matching transformers 5.23's Qwen3NextForCausalLM: zero-centred RMSNorms,
gated softmax attention, gated DeltaNet linear attention (the shared steps/models/gated_deltanet.py), the sparse
block with its sigmoid-gated shared expert, the hybrid decoder layer and the causal LM.

Module names are the checkpoint's tensor names except one: the shared MoE block (steps/models/moe.py) names the
shared expert `shared_experts`, the checkpoint `shared_expert`; the state-dict adapter (state_dict_adapter.py) maps
the two. The linear-attention layers hold Qwen3-Next's own tensors (in_proj_qkvz and in_proj_ba, grouped per key
head; conv1d.weight; norm.weight: Qwen3NextGatedDeltaNet) and regroup the two projections into the shared
GatedDeltaNet's fused one at each call (a copy of the weights' rows: the arithmetic is GatedDeltaNet's).

Read top to bottom: the norm (Qwen3NextRMSNorm: weight stored as w, applied as 1 + w, in fp32), the experts and the
MoE block (router kind softmax_topk with norm_topk_prob, one shared expert scaled by sigmoid(shared_expert_gate(x))),
gated attention (q_proj gives per head a query and a gate; q/k RMS-normed per head; the first
head_dim * partial_rotary_factor dims rotated; the output times sigmoid(gate) before o_proj), the decoder layer (a
linear_attn or a self_attn token mixer, by layer_types) and the causal LM (the shared skeleton,
steps/models/causal_lm.py).

Padding and packing in the linear-attention layers, which read the token layout of AttentionMasks (valid, segments)
instead of a mask: padding's hidden states are zeroed (transformers' apply_mask_to_padding_states), so a left-padded
prompt starts from the zero state exactly and right padding (the trainer's rows) comes after every real token; a
packed row's sequences (trainer.sequence_packing) each start from the zero state, no conv tap or state crossing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import MoeCausalLM
from steps.models.experts import SwiGLUExpert
from steps.models.gated_deltanet import GatedDeltaNet, from_grouped_projections
from steps.models.layers import AttentionMasks, apply_partial_rotary, rotary_cos_sin, softmax_attention
from steps.models.moe import RouterSettings, SparseMoeBlock
from steps.models.placement import layer_share
from steps.models.qwen3_next.config import Qwen3NextConfig

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3NextRMSNorm: x / rms(x) * (1 + weight), all in fp32, cast back last; the weight starts at zero."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Expert(SwiGLUExpert):
    """One SwiGLU feed-forward block, down(silu(gate(x)) * up(x)), named as Qwen3NextMLP writes it: a routed expert,
    the shared expert, and the dense MLP of the layers that are not sparse."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.gate_proj, self.up_proj, self.down_proj


class MoeBlock(SparseMoeBlock):
    """Qwen3NextSparseMoeBlock: the shared block, its softmax top-k router `gate`, experts `experts.{e}` for the
    global expert ids this rank holds, and the shared expert `shared_experts` scaled by
    sigmoid(`shared_expert_gate`(x)), replicated on every rank."""

    expert_class = Expert


class _Weight(nn.Module):
    """A module holding one parameter as `weight`: the checkpoint's name of GatedDeltaNet's conv and norm weights
    (linear_attn.conv1d.weight, linear_attn.norm.weight)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """The shared GatedDeltaNet (its forward, prefill and step) over Qwen3NextGatedDeltaNet's parameters:
    in_proj_qkvz [2*Hk*Dk + 2*Hv*Dv, H] and in_proj_ba [2*Hv, H], grouped per key head, regrouped into the fused
    projection at each call (from_grouped_projections); conv1d.weight [conv channels, 1, K]; A_log, dt_bias [Hv];
    norm.weight [Dv] (the gated norm's plain weight); out_proj."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__(
            hidden_size=cfg.hidden_size, linear_num_key_heads=cfg.linear_num_key_heads,
            linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
            linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
            rms_norm_eps=cfg.rms_norm_eps,
        )  # fmt: skip
        del self.projection
        conv, norm = self._parameters.pop("conv_weight"), self._parameters.pop("norm_weight")
        assert conv is not None and norm is not None
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.num_value_heads, bias=False)
        self.conv1d = _Weight(conv)
        self.norm = _Weight(norm)

    @property  # type: ignore[override]
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight

    @property  # type: ignore[override]
    def norm_weight(self) -> torch.Tensor:
        return self.norm.weight

    def fused_projection(self) -> torch.Tensor:
        """GatedDeltaNet's fused input projection weight (rows q | k | v | z | b | a) from the grouped two."""
        return from_grouped_projections(
            self.in_proj_qkvz.weight, self.in_proj_ba.weight,
            self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim,
        )  # fmt: skip

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = self.num_value_heads
        return F.linear(x, self.fused_projection()).split([self.conv_dim, self.value_dim, heads, heads], dim=-1)


class GatedAttention(nn.Module):
    """Qwen3NextAttention: grouped-query softmax attention whose q_proj gives, per head, head_dim query rows then
    head_dim gate rows; q and k RMS-normed per head (zero-centred), partial rotary, the attention's output times
    sigmoid(gate) before o_proj. No biases (attention_bias is refused)."""

    def __init__(self, cfg: Qwen3NextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] and rope (cos, sin [B, T, rotary_dim]) -> q [B, heads, T, D], k and v [B, kv_heads, T, D]
        (q and k normed, then rotated over their first rotary_dim dims) and the gate [B, T, heads * D]."""
        batch, seq, _ = x.shape
        q, gate = self.q_proj(x).view(batch, seq, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        gate = gate.reshape(batch, seq, self.num_heads * self.head_dim)
        return apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin), v, gate

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D], gated, then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        out = softmax_attention(q, k, v, mask, self.scaling).transpose(1, 2)
        out = out.reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out * torch.sigmoid(gate))


def _real(masks: AttentionMasks, x: torch.Tensor) -> torch.Tensor | None:
    """The real tokens [B, T] as x's dtype (GatedDeltaNet zeroes the others' hidden states), None when all are."""
    return None if masks.valid is None else masks.valid.to(x.dtype)


class Qwen3NextDecoderLayer(nn.Module):
    """Qwen3NextDecoderLayer: x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(x)); the mixer is
    `linear_attn` (Qwen3NextGatedDeltaNet) or `self_attn` (GatedAttention), as layer_types says (the checkpoint's
    names)."""

    def __init__(
        self, mixer: nn.Module, mlp: nn.Module, input_layernorm: nn.Module, post_attention_layernorm: nn.Module
    ) -> None:
        super().__init__()
        self.linear = isinstance(mixer, Qwen3NextGatedDeltaNet)
        if self.linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], masks: AttentionMasks) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear:
            x = x + self.linear_attn(h, _real(masks, h), masks.segments)
        else:
            q, k, v, gate = self.self_attn.project(h, rope)
            x = x + self.self_attn.attend(q, k, v, gate, masks.get(None))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_shared_prompts(
        self,
        prompt_x: torch.Tensor,
        response_x: torch.Tensor,
        prompt_rope: tuple[torch.Tensor, torch.Tensor],
        response_rope: tuple[torch.Tensor, torch.Tensor],
        prompt_masks: AttentionMasks,
        response_masks: AttentionMasks,
        prompt_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on prompts [G, P, H] (left-padded) and responses [R, T, H] (right-padded), as
        causal_lm.DecoderLayer.forward_shared_prompts: a softmax layer's responses attend to their prompt's k/v; a
        linear-attention layer's responses continue from their prompt's state (conv window and recurrent matrix,
        GatedDeltaNet.prefill), through which their gradients reach the prompt."""
        hp, hr = self.input_layernorm(prompt_x), self.input_layernorm(response_x)
        if self.linear:
            attn = self.linear_attn
            prompt_out, state = attn.prefill(hp, None, _real(prompt_masks, hp))
            prompt_x = prompt_x + prompt_out
            if response_x.shape[1]:
                state = (state[0].index_select(0, prompt_index), state[1].index_select(0, prompt_index))
                response_x = response_x + attn.prefill(hr, state, _real(response_masks, hr))[0]
        else:
            attn = self.self_attn
            qp, kp, vp, gp = attn.project(hp, prompt_rope)
            qr, kr, vr, gr = attn.project(hr, response_rope)
            k = torch.cat([kp.index_select(0, prompt_index), kr], dim=2)
            v = torch.cat([vp.index_select(0, prompt_index), vr], dim=2)
            prompt_x = prompt_x + attn.attend(qp, kp, vp, gp, prompt_masks.get(None))
            response_x = response_x + attn.attend(qr, k, v, gr, response_masks.get(None))
        # One MLP call over the prompt and the response tokens (one expert dispatch per layer, as forward).
        hidden = prompt_x.shape[-1]
        tokens = torch.cat([prompt_x.reshape(-1, hidden), response_x.reshape(-1, hidden)])
        out = self.mlp(self.post_attention_layernorm(tokens))
        num_prompt = prompt_x.shape[0] * prompt_x.shape[1]
        return prompt_x + out[:num_prompt].view_as(prompt_x), response_x + out[num_prompt:].view_as(response_x)


def decoder_layer(
    cfg: Qwen3NextConfig, layer_idx: int, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> Qwen3NextDecoderLayer:
    """Qwen3NextDecoderLayer: its token mixer by layer_types, then the sparse block (or, off the sparse layers, the
    dense MLP)."""
    mixer: nn.Module
    if cfg.is_linear_attention(layer_idx):
        mixer = Qwen3NextGatedDeltaNet(cfg)
    else:
        mixer = GatedAttention(cfg, layer_idx)
    mlp: nn.Module
    if cfg.is_moe_layer(layer_idx):
        slots, ep_size = layer_share(cfg, placement, layer_idx)
        mlp = MoeBlock(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
            slots,
            ep_rank,
            ep_size,
            router=RouterSettings(kind="softmax_topk"),
            shared_intermediate_size=cfg.shared_expert_intermediate_size,
            shared_expert_gate=True,
        )
    else:
        mlp = Expert(cfg.hidden_size, cfg.intermediate_size)  # Qwen3NextMLP with intermediate_size
    norms = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps), ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return Qwen3NextDecoderLayer(mixer, mlp, *norms)


class Qwen3NextCausalLM(MoeCausalLM):
    """Qwen3-Next causal LM (steps/models/causal_lm.py), without the multi-token-prediction module (config.py).
    state_dict() keys are the family's module names; the state-dict adapter gives the checkpoint's."""

    config: Qwen3NextConfig

    def __init__(self, config: Qwen3NextConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.build(
            lambda layer: decoder_layer(config, layer, placement, ep_rank),
            lambda: ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps),
        )

    def init_extra(self, module: nn.Module) -> None:
        """As Qwen3NextPreTrainedModel._init_weights: the zero-centred norms at zero, DeltaNet's dt_bias at one and
        A_log = log(uniform(0.01, 16)) (its conv and gated-norm weights keep their construction's init)."""
        if isinstance(module, ZeroCentredRMSNorm):
            module.weight.zero_()
        elif isinstance(module, GatedDeltaNet):
            module.dt_bias.fill_(1.0)
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log_())

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rotary_dim]: default RoPE over the rotated dims (inv_freq = theta^(-2i/rotary_dim))."""
        return rotary_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, dtype)
