"""Sampling one decode step for a batch of rows: each row's token is the inverse CDF of its sampling distribution
(temperature, top-k, top-p) at a uniform of the sample's own counter-based random stream (sample_uniforms), so a
sample's tokens depend on its own logits and seed only (the torch engine's determinism, steps/engines/torch_engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from steps.engines.interface import SamplingParams
from steps.models.kernels import token_logprobs

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def sample_uniforms(seeds: Sequence[int], steps: int) -> torch.Tensor:
    """[len(seeds), steps] float64 uniforms in [0, 1): row r, step t is SplitMix64 of seeds[r] at counter t.

    A counter-based generator: each sample's stream depends on its own seed only (like a torch.Generator
    seeded with it), is computed for all rows at once, and is the same on every machine (unsigned 64-bit
    arithmetic, which numpy defines to wrap around).
    """
    seeds_u64 = np.array([s % 2**64 for s in seeds], dtype=np.uint64)[:, None]
    with np.errstate(over="ignore"):
        z = seeds_u64 + _GOLDEN * np.arange(1, steps + 1, dtype=np.uint64)[None, :]
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


# ----------------------------------------------------------------------------------------------------
# Sampling one step for a batch of rows
# ----------------------------------------------------------------------------------------------------


def sample_next(
    logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], uniforms [B] in [0, 1) -> (tokens [B] int64, policy log-probs [B] float32).

    Sampling is the inverse CDF at each row's uniform, so a row's token depends on its own logits and
    uniform only. Top-k/top-p work on the tokens sorted by probability (stable sort: ties keep vocabulary
    order); without them the CDF runs in vocabulary order and nothing is sorted.
    """
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits.double() / params.temperature
        order = None
        if params.top_k or params.top_p < 1:
            scaled, order = scaled.sort(dim=-1, descending=True, stable=True)
        probs = torch.softmax(scaled, dim=-1)
        if order is not None:
            keep = torch.ones_like(probs, dtype=torch.bool)
            if params.top_k:
                keep[:, params.top_k :] = False
            if params.top_p < 1:
                # A token stays if the mass of the tokens before it is still below top_p (the first always).
                keep &= (probs.cumsum(dim=-1) - probs) < params.top_p
            probs = probs * keep
        cdf = probs.cumsum(dim=-1)
        target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
        picked = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
        tokens = (picked if order is None else order.gather(1, picked)).squeeze(1)
    return tokens, token_logprobs(logits, tokens)
