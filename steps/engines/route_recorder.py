"""What the torch engine records for replay in training: each sample's routed experts (Generation.routed_experts),
from the experts its decoder's MoE layers chose in one generate call (steps/engines/torch_engine.py Decoder.routes),
and for a DeepSeek-sparse-attention model the keys its indexers selected (Generation.selected_keys)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from steps.models.layers import SelectionShape
from steps.models.moe import SparseMoeBlock


def drain(taken: list[torch.Tensor], layers: int, what: str) -> list[torch.Tensor]:
    """One forward's record (a recorder's `taken`, emptied for the next): one tensor a layer, `layers` of them."""
    out = list(taken)
    taken.clear()
    if len(out) != layers:
        raise RuntimeError(f"recorded {len(out)} {what} in a forward over {layers}")
    return out


class RouteRecorder:
    """Each sample's routed experts (Generation.routed_experts) from the decoder's record of one generate call:
    the decoder appends each MoE layer's chosen experts [rows, k] of every forward to `taken`, in layer order.

    The prefill routes the distinct prompts' W (left-padded) columns through every MoE layer but the last, where
    only each prompt's last position runs (its logits are all that is needed), so the last layer's record of a
    prompt's earlier tokens is -1 (none: those tokens' outputs there reach no log-prob). Decode step s feeds
    each live sample's token s through its state's row. A sample of n tokens gets its prompt's positions and its
    first n - 1 tokens (the last is sampled and never fed)."""

    def __init__(self, layers: Sequence[nn.Module], samples: int, steps: int) -> None:
        self.layers = [i for i, layer in enumerate(layers) if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)]
        self.top_k = layers[self.layers[0]].mlp.top_k if self.layers else 0  # type: ignore[union-attr]
        self.prompts = torch.empty(0)
        self.prompt_of: list[int] = []
        self.responses = torch.full((samples, max(steps - 1, 0), len(self.layers), self.top_k), -1, dtype=torch.int16)
        self.taken: list[torch.Tensor] = []

    def _taken(self) -> list[torch.Tensor]:
        return drain(self.taken, len(self.layers), "MoE layers' routes")

    def prefilled(self, prompts: int, width: int, prompt_of: torch.Tensor) -> None:
        """After the prefill of `prompts` distinct prompts, `width` columns each; prompt_of [samples]: each one's
        prompt."""
        self.prompt_of = prompt_of.tolist()
        taken = self._taken()
        self.prompts = torch.full((prompts, width, len(self.layers), self.top_k), -1, dtype=torch.int16)
        for index, chosen in enumerate(taken):
            if chosen.shape[0] == prompts * width:
                self.prompts[:, :, index] = chosen.view(prompts, width, -1).to(torch.int16).cpu()
            else:  # the last layer: the last position of each prompt only
                self.prompts[:, -1, index] = chosen.to(torch.int16).cpu()

    def stepped(self, step: int, samples: torch.Tensor, rows: torch.Tensor) -> None:
        """After decode step `step` fed token `step` of `samples` through batch rows `rows`."""
        taken = self._taken()
        if taken:
            chosen = torch.stack(taken, dim=1).index_select(0, rows).to(torch.int16).cpu()  # [samples, layers, k]
            self.responses[samples.cpu(), step] = chosen

    def sample(self, row: int, prompt_len: int, tokens: int) -> np.ndarray:
        """[prompt_len + tokens - 1, MoE layers, k] int16 of sample `row` (of `tokens` response tokens)."""
        prompt = self.prompts[self.prompt_of[row], self.prompts.shape[1] - prompt_len :]
        return torch.cat([prompt, self.responses[row, : tokens - 1]]).numpy()


class SelectionRecorder:
    """Each sample's selected keys (Generation.selected_keys) for a model with indexers (MoeCausalLM.selection_shape:
    DeepSeek sparse attention's keys, DeepSeek-V4's compressed entries), from the selections its decode made in one
    generate call: each forward appends, for every indexer (layer order), the keys each query attended to, a bool
    [rows, queries, columns] over the rows' slots (DeepSeek sparse attention: a prompt's left padding first) or over
    the row's windows (DeepSeek-V4: window w at column w).

    Only queries that see more than `topk` keys are recorded (SelectionShape.first_query on): before, a query
    attends to all it sees whatever the indexer scores. Keys are the sequence's (padding left out)."""

    def __init__(self, shape: SelectionShape, samples: int) -> None:
        self.shape, self.layers = shape, shape.layers
        self.taken: list[torch.Tensor] = []
        self.prompt_of: list[int] = []
        self.prompts: list[np.ndarray] = []  # per prompt: [n - first, layers, its keys] bool
        self.pads = np.zeros(0, dtype=np.int64)  # per prompt: its left padding in the prefill
        self.lengths = np.zeros(0, dtype=np.int64)  # per prompt: its tokens
        self.responses: list[dict[int, np.ndarray]] = [{} for _ in range(samples)]  # step -> [layers, keys] bool

    def _taken(self) -> torch.Tensor:
        return torch.stack(drain(self.taken, self.layers, "indexer layers' selections"), dim=1)  # [rows, layers, ...]

    def _keys(self, chosen: np.ndarray, pad: int, seen: int) -> np.ndarray:
        """A row's columns [..., columns] -> the sequence's keys [..., seen]."""
        return chosen[..., :seen] if self.shape.over_windows else chosen[..., pad : pad + seen]

    def prefilled(self, valid: torch.Tensor, prompt_of: torch.Tensor) -> None:
        """After the prefill of the left-padded prompts valid [P, W]; prompt_of [samples]: each one's prompt."""
        self.prompt_of = prompt_of.tolist()
        taken = self._taken().cpu().numpy()
        self.lengths = valid.sum(dim=1).cpu().numpy()
        self.pads = valid.shape[1] - self.lengths
        first = self.shape.first_query
        self.prompts = [
            self._keys(taken[p, :, pad + first :], int(pad), self.shape.keys(int(n))).transpose(1, 0, 2)
            for p, (pad, n) in enumerate(zip(self.pads.tolist(), self.lengths.tolist(), strict=True))
        ]

    def stepped(self, step: int, samples: torch.Tensor, rows: torch.Tensor) -> None:
        """After decode step `step` fed response token `step` of `samples` through batch rows `rows`."""
        taken = self._taken()[:, :, 0].index_select(0, rows).cpu().numpy()  # [samples, layers, columns]
        for sample, chosen in zip(samples.tolist(), taken, strict=True):
            prompt = self.prompt_of[sample]
            position = int(self.lengths[prompt]) + step
            if position >= self.shape.first_query:
                self.responses[sample][step] = self._keys(chosen, int(self.pads[prompt]), self.shape.keys(position + 1))

    def sample(self, row: int, prompt_len: int, tokens: int) -> np.ndarray:
        """[queries, layers, ceil(keys / 8)] uint8 of sample `row` (of `tokens` response tokens), fed = prompt_len +
        tokens - 1, the queries SelectionShape.queries(fed), keys SelectionShape.keys(fed): query t's keys as bits
        (np.packbits, big-endian), key s at bit s."""
        fed, first = prompt_len + tokens - 1, self.shape.first_query
        selected = np.zeros((self.shape.queries(fed), self.layers, self.shape.keys(fed)), dtype=bool)
        prompt = self.prompts[self.prompt_of[row]]
        selected[: len(prompt), :, : prompt.shape[-1]] = prompt
        for step, chosen in self.responses[row].items():
            if step < tokens - 1:
                selected[prompt_len + step - first, :, : chosen.shape[-1]] = chosen
        return np.packbits(selected, axis=-1)


def indexed_selection_recorder(model: nn.Module, samples: int) -> SelectionRecorder | None:
    """The SelectionRecorder of a model with indexers (MoeCausalLM.selection_shape); None without."""
    shape = model.selection_shape()  # type: ignore[operator]
    return None if shape is None else SelectionRecorder(shape, samples)
