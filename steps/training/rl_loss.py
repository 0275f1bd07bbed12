"""The RL objective: PPO-clip with clip-higher, truncated importance sampling and a k3 KL penalty.

Per response token t of a sample with advantage A (all log-probs are of the sampled token):

    ratio_t = exp(logp_t - old_logp_t)                       old: the trainer's policy before this update
    w_t     = min(exp(old_logp_t - behavior_logp_t), is_cap)  truncated importance weight, no gradient:
                                                             corrects staleness (samples from an older
                                                             version) and engine mismatch (SGLang vs torch)
    pg_t    = -w_t * min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)   (DAPO clip-higher)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      k3 estimator of KL(policy || reference)
    loss_t  = pg_t + kl_coef * kl_t

Aggregation over the global batch:
    token-mean  sum of loss_t over all response tokens / number of response tokens
    seq-mean    mean over sequences of (sum of loss_t in the sequence / its response tokens)

The global count (tokens or sequences) is passed in as `normalizer`, so that each rank (and each
micro-batch) adds its share and the shares sum to the global mean however the batch is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossAgg = Literal["token-mean", "seq-mean"]


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = 0.0
    is_cap: float = 2.0


def truncated_is_weight(old_logp: torch.Tensor, behavior_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(old - behavior), cap), detached: a weight on the loss, never a path for gradients."""
    return torch.exp(old_logp.detach() - behavior_logp.detach()).clamp(max=cap)


def ppo_clip_objective(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (-min(r*A, clip(r)*A), ratio r, whether the clipped branch is the one taken).

    advantages broadcast against logp ([B] -> [B, 1] for per-sequence advantages).
    """
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    clip_active = clipped < unclipped  # min picks the clipped value: r beyond the bound on A's side
    return -torch.minimum(unclipped, clipped), ratio, clip_active


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """exp(ref - logp) - (ref - logp) - 1 per token: unbiased for KL(policy || ref), always >= 0."""
    delta = ref_logp.detach() - logp
    return torch.exp(delta) - delta - 1.0


@dataclass
class TokenTerms:
    """The per-token pieces of the objective ([B, T], zero outside the response mask)."""

    loss: torch.Tensor
    pg: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor
    is_weight: torch.Tensor
    clip_active: torch.Tensor
    mask: torch.Tensor


def token_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    ref_logp: torch.Tensor | None = None,
) -> TokenTerms:
    """All per-token terms. Positions outside `mask` (prompt, padding) are zeroed with torch.where, not by
    multiplication, so that whatever the log-probs hold there (inf, nan) never reaches the loss."""
    mask = mask.bool()
    zero = torch.zeros_like(logp)
    logp = torch.where(mask, logp, zero)
    old_logp = torch.where(mask, old_logp, zero)
    behavior_logp = torch.where(mask, behavior_logp, zero)
    is_weight = torch.where(mask, truncated_is_weight(old_logp, behavior_logp, settings.is_cap), zero)
    surrogate, ratio, clip_active = ppo_clip_objective(
        logp, old_logp, advantages, settings.clip_low, settings.clip_high
    )
    pg = torch.where(mask, is_weight * surrogate, zero)
    if ref_logp is not None and settings.kl_coef > 0:
        kl = torch.where(mask, k3_kl(logp, torch.where(mask, ref_logp, zero)), zero)
        loss = pg + settings.kl_coef * kl
    else:
        kl = zero
        loss = pg
    return TokenTerms(
        loss=loss, pg=pg, kl=kl, ratio=torch.where(mask, ratio, zero), is_weight=is_weight,
        clip_active=clip_active & mask, mask=mask,
    )  # fmt: skip


def aggregate(values: torch.Tensor, mask: torch.Tensor, loss_agg: LossAgg, normalizer: float) -> torch.Tensor:
    """This batch's share of the global token-mean or seq-mean of `values` ([B, T], zero off-mask).

    normalizer: the global number of response tokens (token-mean) or of sequences (seq-mean).
    """
    if loss_agg == "token-mean":
        return values.sum() / normalizer
    if loss_agg == "seq-mean":
        per_seq_tokens = mask.sum(dim=-1).clamp(min=1)
        return (values.sum(dim=-1) / per_seq_tokens).sum() / normalizer
    raise ValueError(f"loss_agg {loss_agg!r}: use 'token-mean' or 'seq-mean'")


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: logits [..., V] -> [...] (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
