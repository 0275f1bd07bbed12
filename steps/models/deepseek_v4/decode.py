"""The torch engine's incremental forward of DeepSeek-V4 (attention kind compressed_kv_cache; driven by
steps/engines/state_decoder.py): a StatefulDecode whose rows keep, per layer, every slot's key=value and the
compressors' and indexer's projections of its token (KeyInputs), which the compressed windows pool. A step feeds
one token a row through the model's own modules (weights updated in place are seen): the layer's attention over the
row's slots (the sliding window and the windows complete at that position), its MoE block routing the token by its
id in the hash layers. So its logits equal one full forward's up to float rounding and the CSA indexer's tie-breaks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.compressed_attention import KeyInputs
from steps.models.deepseek_v4.model import DecoderLayer, DeepseekV4ForCausalLM
from steps.models.hyper_connections import HyperConnection
from steps.models.layers import AttentionMasks


@dataclass
class CompressedRows:
    """Every layer's KeyInputs of the rows' slots [R, S, *]; `valid` [R, S] the real slots (a prompt's left padding is
    not), `positions` [R, S] each slot's position in its sequence."""

    layers: list[KeyInputs]
    valid: torch.Tensor
    positions: torch.Tensor


class CompressedDecode:
    """StatefulDecode (steps/models/family.py) of a DeepseekV4ForCausalLM."""

    def __init__(self, model: nn.Module) -> None:
        assert isinstance(model, DeepseekV4ForCausalLM)
        self.model = model
        # While a list (the torch engine's record, steps/engines/route_recorder.py SelectionRecorder): every forward
        # appends each CSA layer's choice of entries [R, T, W] (layer order; W the row's windows in position order)
        self.recorded: list[torch.Tensor] | None = None

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.model.final_norm(x), self.model.output_weight()).float()

    def _layer(self, layer: DecoderLayer, x: torch.Tensor, rope: Any, masks: AttentionMasks, keys: KeyInputs | None,
               ) -> tuple[torch.Tensor, KeyInputs]:  # fmt: skip
        """One layer on streams x [R, T, N, H]; keys: the rows' earlier slots (None: x's tokens are all of them).
        Returns the streams after it and the keys' inputs with x's tokens appended."""
        post, comb, collapsed = layer.hc_attn(x)
        h = layer.attn_norm(collapsed)
        mine = layer.attn.key_inputs(h, rope[layer.attn.rope_kind])
        keys = mine if keys is None else keys.then(mine)
        x = HyperConnection.mix(post, comb, layer.attention(h, rope, masks, keys, self.recorded), x)
        return layer.feed_forward(x, masks.token_ids), keys

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, CompressedRows]:
        """Left-padded prompts [P, T] -> logits after each prompt's last token [P, V] and the rows' state."""
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        masks = AttentionMasks.causal(valid, positions)
        masks.token_ids = ids
        x = self.model.embed(ids)
        rope = self.model.rotary(positions, x.dtype)
        layers = []
        for layer in self.model.model.layers:
            x, keys = self._layer(layer, x, rope, masks, None)
            layers.append(keys)
        return self._logits(x[:, -1]), CompressedRows(layers, valid, positions)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, state: CompressedRows) -> tuple[torch.Tensor, Any]:
        """One token a row at `positions` [R] -> logits [R, V] and the state after it."""
        valid = torch.cat([state.valid, torch.ones_like(state.valid[:, :1])], dim=1)
        slots = torch.cat([state.positions, positions[:, None]], dim=1)
        # the new token sees every real slot (the sliding window and the compressed windows narrow that)
        masks = AttentionMasks(valid[:, None, None, :], positions[:, None], slots, valid[:, -1:])
        masks.key_valid, masks.token_ids = valid, tokens[:, None]
        x = self.model.embed(tokens[:, None])
        rope = self.model.rotary(positions[:, None], x.dtype)
        layers = []
        for layer, keys in zip(self.model.model.layers, state.layers, strict=True):
            x, keys = self._layer(layer, x, rope, masks, keys)
            layers.append(keys)
        return self._logits(x[:, 0]), CompressedRows(layers, valid, slots)

    def select(self, state: CompressedRows, rows: torch.Tensor) -> CompressedRows:
        return CompressedRows([keys.select(rows) for keys in state.layers], state.valid.index_select(0, rows),
                              state.positions.index_select(0, rows))  # fmt: skip


def decode_model(model: nn.Module) -> Any:
    """DeepSeek-V4's StatefulDecode (its ModelFamily.decode)."""
    return CompressedDecode(model)
