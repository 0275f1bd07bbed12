"""The torch engine's decoder for models whose layers keep a state per row (the attention kind recurrent_state:
gated DeltaNet's recurrent matrix and conv window beside softmax layers' key/value caches, Qwen3-Next and
Qwen3.5-MoE).

The family runs its own layers incrementally (steps/models/family.py StatefulDecode: prefill, step, select); this
module gives the engine's generate loop (steps/engines/torch_engine.py) the same two calls and batch it drives for
softmax models: `prefill(ids, valid, room)` -> (batch, logits) and `step(tokens, batch)` -> logits, where the batch
selects rows (samples that drew different tokens split a row; finished ones are dropped). Each sample's
randomness, stop tokens and log-probs stay the engine's. A row's state is its own: nothing is shared between the
samples of a prompt beyond the prefill, which runs once per distinct prompt and is then selected per sample.

Recording for replay in training (rollout.record_routes): the MoE blocks append their routers' choices (`routes`),
and an indexed-attention decode its indexers' selections (`selections`), as the engine's recorders read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from steps.models.family import STATEFUL_ATTENTION, StatefulDecode
from steps.models.registry import family_of


@dataclass
class StateBatch:
    """The rows being decoded: the family's state of each row and the position of its next token."""

    state: Any
    positions: torch.Tensor  # [R] long
    decode: StatefulDecode

    def select(self, rows: torch.Tensor) -> StateBatch:
        return StateBatch(self.decode.select(self.state, rows), self.positions.index_select(0, rows), self.decode)


class StateDecoder:
    """Decoder (torch_engine.py) for the attention kinds a family decodes itself (STATEFUL_ATTENTION: recurrent_state,
    indexed_kv_cache), over the family's StatefulDecode."""

    def __init__(self, model: nn.Module) -> None:
        family = family_of(model)
        assert family.attention in STATEFUL_ATTENTION, family.attention
        self.model = model
        self.decode: StatefulDecode = family.decode(model)
        self._routes: list[torch.Tensor] | None = None

    @property
    def routes(self) -> list[torch.Tensor] | None:
        """Routing replay's record (steps/engines/route_recorder.py RouteRecorder.taken): while a list, every MoE
        layer's forward appends its routers' choice [tokens, k] to it, in layer order."""
        return self._routes

    @routes.setter
    def routes(self, taken: list[torch.Tensor] | None) -> None:
        self._routes = taken
        for block in self.model.moe_blocks():  # type: ignore[operator]
            block.recorded_choices = taken

    @property
    def selections(self) -> list[torch.Tensor] | None:
        """The record of the keys an indexed-attention model's queries selected (SelectionRecorder.taken)."""
        return getattr(self.decode, "recorded", None)

    @selections.setter
    def selections(self, taken: list[torch.Tensor] | None) -> None:
        if not hasattr(self.decode, "recorded"):
            raise RuntimeError(f"{type(self.decode).__name__} selects no keys: nothing to record")
        self.decode.recorded = taken  # type: ignore[attr-defined]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def refresh(self) -> None:
        """Nothing is copied out of the model's weights: the family's decode reads its modules."""

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, room: int) -> tuple[StateBatch, torch.Tensor]:
        logits, state = self.decode.prefill(ids, valid)
        return StateBatch(state, valid.sum(dim=1), self.decode), logits

    def step(self, tokens: torch.Tensor, batch: StateBatch) -> torch.Tensor:  # type: ignore[override]
        logits, batch.state = self.decode.step(tokens, batch.positions, batch.state)
        batch.positions = batch.positions + 1
        return logits
