"""The torch engine's incremental forward of a built Qwen3-Next model (its attention kind is recurrent_state,
steps/models/family.py StatefulDecode; the engine drives it through steps/engines/state_decoder.py).

A row's state is, per decoder layer: a linear-attention layer's gated-DeltaNet state (conv window [R, C, K] and
recurrent matrix [R, Hv, Dk, Dv], Qwen3NextGatedDeltaNet.prefill / step), a full-attention layer's keys and values
[R, kv_heads, S, D] with the slots that are real ([R, S]: a prompt's left padding is not). The prefill runs each
layer as the model's forward does over left-padded prompts; a step feeds one token a row through the same modules
(the MoE block, the gated attention's projections and o_proj), so the logits equal the full forward's up to float
rounding (tests/test_family_qwen3_next.py checks it against transformers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.layers import attention_mask_for
from steps.models.qwen3_next.model import Qwen3NextCausalLM, Qwen3NextDecoderLayer


@dataclass
class RowsState:
    """Every layer's state of the rows: (conv_state, recurrent_state) or (keys, values); `valid` [R, S] marks the
    real key slots of the full-attention layers (shared by all of them)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    valid: torch.Tensor


class Qwen3NextDecode:
    """StatefulDecode of a Qwen3NextCausalLM (reads its modules: weights updated in place are seen)."""

    def __init__(self, model: nn.Module) -> None:
        assert isinstance(model, Qwen3NextCausalLM)
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
            assert isinstance(layer, Qwen3NextDecoderLayer)
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
    """The family's StatefulDecode (steps/models/family.py)."""
    return Qwen3NextDecode(model)
