"""The train-inference mismatch of an iteration: how far the trainer's log-probs of the sampled tokens, under the
weights the samples were drawn for (before the update's first step), are from the engine's behaviour log-probs.
On a GPU the engine (SGLang: its own kernels, precision and fused MoE) and the trainer differ, and MoE routing
amplifies it; the peers' runs collapse when it grows ("When Speed Kills Stability", Liu, Li et al. 2025).

Per response token, with r = exp(trainer - behaviour) (the importance ratio behaviour -> trainer):

    k3        r - 1 - log r: Schulman's k3 estimator of KL(behaviour || trainer) from the engine's samples,
              averaged over the tokens
    ratio     its max, min and the 1st, 50th and 99th percentiles over the iteration's tokens (every rank's): the
              extremes exactly, the percentiles from a histogram of log r (BINS bins over [-LOG_RANGE, LOG_RANGE],
              so to within half a bin, 0.25%; tokens beyond the range fall in the end bins)

A rank adds its tokens (add), reduce() sums every rank's in one gather. A token whose log-probs are not finite is
counted (nonfinite_tokens) and left out of the figures: the update's own check stops on a non-finite loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from steps.expert_parallel.mesh import Mesh, gather_ranks

BINS = 2000
LOG_RANGE = 5.0
QUANTILES = {"p01": 0.01, "p50": 0.5, "p99": 0.99}


class MismatchStats:
    """This rank's running sums: tokens, the k3 sum, the log-ratio histogram and its extremes."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.nonfinite = 0.0
        self.k3 = 0.0
        self.hist = torch.zeros(BINS, dtype=torch.float64)
        self.log_max = -math.inf
        self.log_min = math.inf

    def add(self, trainer_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor) -> None:
        """Tokens where mask is set, their trainer and behaviour log-probs (any matching shapes)."""
        mask = mask.bool()
        log_r = (trainer_logp.detach().double() - behavior_logp.detach().double())[mask].cpu()
        finite = torch.isfinite(log_r)
        self.nonfinite += float((~finite).sum())  # the step's own check names a non-finite loss: counted only
        log_r = log_r[finite]
        if not log_r.numel():
            return
        self.tokens += float(log_r.numel())
        self.k3 += float((log_r.exp() - 1.0 - log_r).sum())
        index = ((log_r + LOG_RANGE) / (2 * LOG_RANGE) * BINS).floor().clamp(0, BINS - 1).long()
        self.hist += torch.bincount(index, minlength=BINS).double()
        self.log_max = max(self.log_max, float(log_r.max()))
        self.log_min = min(self.log_min, float(log_r.min()))

    def reduce(self, mesh: Mesh) -> dict[str, Any] | None:
        """Every rank's sums (one collective, every rank calls it): the iteration's figures, None without tokens."""
        head = [self.tokens, self.k3, self.log_max, -self.log_min, self.nonfinite]
        mine = torch.cat([torch.tensor(head, dtype=torch.float64), self.hist])
        every = gather_ranks(mine.to(mesh.device), mesh).cpu()
        tokens, k3, nonfinite = float(every[:, 0].sum()), float(every[:, 1].sum()), int(every[:, 4].sum())
        if tokens == 0:
            return None
        hist = every[:, len(head) :].sum(0)
        cumulative = hist.cumsum(0) / tokens
        width = 2 * LOG_RANGE / BINS
        ratio = {"max": math.exp(float(every[:, 2].max())), "min": math.exp(-float(every[:, 3].max()))}
        for name, q in QUANTILES.items():
            bin_index = int(torch.searchsorted(cumulative, torch.tensor(q, dtype=torch.float64)))
            center = math.exp(-LOG_RANGE + (min(bin_index, BINS - 1) + 0.5) * width)
            ratio[name] = min(max(center, ratio["min"]), ratio["max"])  # a bin's center may lie past the extremes
        return {"k3": k3 / tokens, "ratio": ratio, "tokens": int(tokens), "nonfinite_tokens": nonfinite}
