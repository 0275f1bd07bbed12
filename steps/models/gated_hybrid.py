"""Qwen's hybrid decoder, shared by the families that have it (Qwen3-Next, Qwen3.5-MoE): gated DeltaNet linear
attention (steps/models/gated_deltanet.py) in most layers, gated softmax attention in every full_attention_interval-th,
zero-centred RMSNorms, the shared MoE block after each; the torch engine's incremental forward over it.

A family brings its checkpoint's DeltaNet projections (a CheckpointDeltaNet subclass), its experts and its config;
the config is read by duck typing: hidden_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
rotary_dim, rope_theta and is_linear_attention(layer).

Read top to bottom: the norm (weight stored as w, applied as 1 + w, in fp32), the DeltaNet over a checkpoint's
parameter names, gated attention (q_proj gives per head a query and a gate; q/k RMS-normed per head; the first
rotary_dim dims rotated; the output times sigmoid(gate) before o_proj), the decoder layer (a linear_attn or a
self_attn token mixer), the causal LM's shared part and the decode (steps/models/family.py StatefulDecode).

Padding and packing in the linear-attention layers, which read the token layout of AttentionMasks (valid, segments)
instead of a mask: padding's hidden states are zeroed (transformers' apply_mask_to_padding_states), so a left-padded
prompt starts from the zero state exactly and right padding (the trainer's rows) comes after every real token; a
packed row's sequences (trainer.sequence_packing) each start from the zero state, no conv tap or state crossing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.causal_lm import MoeCausalLM, mlp_over_prompts_and_responses
from steps.models.gated_deltanet import GatedDeltaNet
from steps.models.layers import (
    AttentionMasks,
    apply_partial_rotary,
    attention_mask_for,
    rotary_cos_sin,
    softmax_attention,
)

LINEAR, FULL = "linear_attention", "full_attention"  # config.json's layer_types


def interval_layer_types(num_layers: int, interval: int) -> list[str]:
    """transformers' (and SGLang's) layer kinds from full_attention_interval: layer i is full attention when
    (i + 1) % interval == 0."""
    return [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3NextRMSNorm / Qwen3_5MoeRMSNorm: x / rms(x) * (1 + weight), all in fp32, cast back last; the weight
    starts at zero."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class _Weight(nn.Module):
    """A module holding one parameter as `weight`: the checkpoint's name of GatedDeltaNet's conv and norm weights
    (linear_attn.conv1d.weight, linear_attn.norm.weight)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class CheckpointDeltaNet(GatedDeltaNet):
    """The shared GatedDeltaNet (its forward, prefill and step) under the checkpoints' names of its conv and norm
    weights (conv1d.weight [conv channels, 1, K], norm.weight [Dv]); a family's subclass replaces the fused input
    projection with its checkpoint's own and gives the split (_split: the conv input, z, b, a)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(
            hidden_size=cfg.hidden_size, linear_num_key_heads=cfg.linear_num_key_heads,
            linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
            linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
            rms_norm_eps=cfg.rms_norm_eps,
        )  # fmt: skip
        del self.projection
        conv, norm = self._parameters.pop("conv_weight"), self._parameters.pop("norm_weight")
        assert conv is not None and norm is not None
        self.conv1d = _Weight(conv)
        self.norm = _Weight(norm)

    @property  # type: ignore[override]
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight

    @property  # type: ignore[override]
    def norm_weight(self) -> torch.Tensor:
        return self.norm.weight

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must split its checkpoint's projections")


class GatedAttention(nn.Module):
    """Qwen3NextAttention / Qwen3_5MoeAttention: grouped-query softmax attention whose q_proj gives, per head,
    head_dim query rows then head_dim gate rows; q and k RMS-normed per head (zero-centred), partial rotary, the
    attention's output times sigmoid(gate) before o_proj. No biases (the families refuse attention_bias)."""

    def __init__(self, cfg: Any, layer_idx: int) -> None:
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


class HybridDecoderLayer(nn.Module):
    """x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(x)); the mixer is `linear_attn` (a
    GatedDeltaNet) or `self_attn` (GatedAttention), as the config's layer kinds say (the checkpoints' names)."""

    def __init__(
        self, mixer: nn.Module, mlp: nn.Module, input_layernorm: nn.Module, post_attention_layernorm: nn.Module
    ) -> None:
        super().__init__()
        self.linear = isinstance(mixer, GatedDeltaNet)
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
        return mlp_over_prompts_and_responses(self, prompt_x, response_x)


def hybrid_layer(cfg: Any, layer_idx: int, linear_attention: type[CheckpointDeltaNet], mlp: nn.Module) -> nn.Module:
    """The decoder layer `layer_idx` of `cfg`: its token mixer by its kind (the family's DeltaNet, or gated
    attention), `mlp`, and the two zero-centred norms."""
    mixer = linear_attention(cfg) if cfg.is_linear_attention(layer_idx) else GatedAttention(cfg, layer_idx)
    norms = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps), ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    return HybridDecoderLayer(mixer, mlp, *norms)


class HybridCausalLM(MoeCausalLM):
    """The causal LM of a hybrid family (steps/models/causal_lm.py): its initialisation and rotary tables."""

    def init_extra(self, module: nn.Module) -> None:
        """As Qwen3NextPreTrainedModel._init_weights: the zero-centred norms at zero, DeltaNet's dt_bias at one and
        A_log = log(uniform(0.01, 16)) (its conv and gated-norm weights keep their construction's init)."""
        if isinstance(module, ZeroCentredRMSNorm):
            module.weight.zero_()
        elif isinstance(module, GatedDeltaNet):
            module.dt_bias.fill_(1.0)
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log_())

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rotary_dim]: default RoPE over the rotated dims (inv_freq = theta^(-2i/rotary_dim)).
        Qwen3.5's multimodal RoPE gives text tokens the same position on its three axes: this table."""
        return rotary_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta, dtype)


# ---------------------------------------------------------------------------------------------------------------
# The torch engine's incremental forward (attention kind recurrent_state; steps/engines/state_decoder.py drives it)


@dataclass
class RowsState:
    """Every layer's state of the rows: (conv_state, recurrent_state) or (keys, values); `valid` [R, S] marks the
    real key slots of the full-attention layers (shared by all of them)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    valid: torch.Tensor


class HybridDecode:
    """StatefulDecode (steps/models/family.py) of a HybridCausalLM, reading its modules (weights updated in place
    are seen). A row's state is, per decoder layer: a linear-attention layer's gated-DeltaNet state (conv window
    [R, C, K] and recurrent matrix [R, Hv, Dk, Dv]), a full-attention layer's keys and values [R, kv_heads, S, D]
    with the slots that are real ([R, S]: a prompt's left padding is not). The prefill runs each layer as the
    model's forward does over left-padded prompts; a step feeds one token a row through the same modules, so the
    logits equal the full forward's up to float rounding."""

    def __init__(self, model: nn.Module) -> None:
        assert isinstance(model, HybridCausalLM)
        self.model = model

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.model.model.norm(x), self.model.output_weight()).float()

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, RowsState]:
        """Left-padded prompts [P, T] -> logits after each prompt's last token [P, V] and the rows' state."""
        x = self.model.model.embed_tokens(ids)
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        rope = self.model.rotary(positions, x.dtype)
        mask = attention_mask_for(valid, 0, ids.shape[1])
        real = valid.to(x.dtype)
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in self.model.model.layers:
            assert isinstance(layer, HybridDecoderLayer)
            h = layer.input_layernorm(x)
            if layer.linear:
                out, state = layer.linear_attn.prefill(h, None, real)
                layers.append(state)
            else:
                q, k, v, gate = layer.self_attn.project(h, rope)
                out = layer.self_attn.attend(q, k, v, gate, mask)
                layers.append((k, v))
            x = x + out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x[:, -1]), RowsState(layers, valid)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, state: RowsState) -> tuple[torch.Tensor, RowsState]:
        """One token a row at `positions` [R] -> logits [R, V] and the state after it (a new RowsState)."""
        x = self.model.model.embed_tokens(tokens)[:, None]  # [R, 1, H]
        rope = self.model.rotary(positions[:, None], x.dtype)
        valid = torch.cat([state.valid, torch.ones_like(state.valid[:, :1])], dim=1)
        mask = attention_mask_for(valid, valid.shape[1] - 1, 1)
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer, previous in zip(self.model.model.layers, state.layers, strict=True):
            h = layer.input_layernorm(x)
            if layer.linear:
                out, new = layer.linear_attn.step(h[:, 0], previous)
                out = out[:, None]
            else:
                q, k, v, gate = layer.self_attn.project(h, rope)
                new = (torch.cat([previous[0], k], dim=2), torch.cat([previous[1], v], dim=2))
                out = layer.self_attn.attend(q, new[0], new[1], gate, mask)
            layers.append(new)
            x = x + out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self._logits(x[:, 0]), RowsState(layers, valid)

    def select(self, state: RowsState, rows: torch.Tensor) -> RowsState:
        return RowsState(
            [(a.index_select(0, rows), b.index_select(0, rows)) for a, b in state.layers],
            state.valid.index_select(0, rows),
        )


def decode_model(model: nn.Module) -> Any:
    """A hybrid family's StatefulDecode (its ModelFamily.decode)."""
    return HybridDecode(model)
