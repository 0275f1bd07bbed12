"""What the torch engine records for routing replay: each sample's routed experts (Generation.routed_experts), from
the experts its decoder's MoE layers chose in one generate call (steps/engines/torch_engine.py Decoder.routes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from steps.models.moe import SparseMoeBlock


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
        taken = list(self.taken)
        self.taken.clear()
        if len(taken) != len(self.layers):
            raise RuntimeError(f"recorded {len(taken)} MoE layers' routes in a forward over {len(self.layers)}")
        return taken

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
