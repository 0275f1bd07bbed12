"""The RL objective: a policy-gradient loss (PPO-clip with clip-higher, GSPO or CISPO), an importance correction of
the engine -> trainer mismatch (truncated or masked, per token or per sequence) and a k3 KL penalty.

Per response token t of sample i with advantage A (all log-probs are of the sampled token):

    r_t     = exp(logp_t - old_logp_t)                        old: the trainer's policy before this update
    rho_t   = exp(old_logp_t - behavior_logp_t)               behaviour (the engine) -> trainer, no gradient
    w_t     the importance correction (trainer.is_correction, at trainer.is_level):
              tis   min(rho, is_cap)                          truncated IS (Yao et al. 2025, "Your efficient RL
                                                              framework secretly brings you off-policy RL training";
                                                              verl rollout_corr_helper.py, slime tis_clip)
              mis   rho where is_lower <= rho <= is_cap, else 0: masked IS (Liu, Li et al. 2025, "When Speed Kills
                                                              Stability"; verl's mask mode, slime's IcePop): a token
                                                              outside the band leaves the gradient
              none  1
              at the sequence level rho is the sequence's geometric mean exp(mean_t log rho_t), the same for each
              of its tokens (verl's geometric / seq_mean_k1)
    pg_t    trainer.loss:
              ppo   -w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)          (DAPO clip-higher)
              gspo  -w * min(s A, clip(s, 1 - clip_low, 1 + clip_high) A), s_t = sg(s_i) r_t / sg(r_t), s_i =
                    exp(mean_t log r_t): the sequence's ratio, its gradient through each token (GSPO-token; Zheng et
                    al. 2025, arXiv 2507.18071, eq. 10-11; verl compute_policy_loss_gspo); clip ranges of order
                    3e-4 / 4e-4 (the paper's section 5.1), aggregated per sequence (seq-mean)
              cispo -w * sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp: the clipped ratio as a weight, the gradient
                    through every token's log-prob (MiniMax-M1, arXiv 2506.13585, eq. 4-5; verl
                    compute_policy_loss_cispo, slime compute_cispo_loss)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      k3 estimator of KL(policy || reference)
    loss_t  = pg_t + kl_coef * kl_t

Aggregation over the global batch:
    token-mean  sum of loss_t over all response tokens / number of response tokens
    seq-mean    mean over sequences of (sum of loss_t in the sequence / its response tokens)

The global count (tokens or sequences) is passed in as `normalizer`, so that each rank (and each
micro-batch) adds its share and the shares sum to the global mean however the batch is split. A token mis
masks out still counts in it (its loss is 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossAgg = Literal["token-mean", "seq-mean"]
PolicyLoss = Literal["ppo", "gspo", "cispo"]
IsCorrection = Literal["none", "tis", "mis"]
IsLevel = Literal["token", "sequence"]


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = 0.0
    is_cap: float = 2.0
    loss: PolicyLoss = "ppo"
    is_correction: IsCorrection = "tis"
    is_level: IsLevel = "token"
    is_lower: float | None = None  # mis's lower bound; None: 1 / is_cap


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its masked positions [B, T] -> [B, 1] (0 for a row without any)."""
    return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)


def importance_correction(
    old_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor, settings: LossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [B, T], where the correction acted [B, T]: capped by tis, masked by mis), detached (module docstring)."""
    log_rho = (old_logp.detach() - behavior_logp.detach()).clamp(-20.0, 20.0)
    if settings.is_level == "sequence":
        log_rho = sequence_mean(log_rho, mask.to(log_rho.dtype)).expand_as(log_rho)
    rho = torch.exp(log_rho)
    if settings.is_correction == "none":
        return torch.ones_like(rho), torch.zeros_like(rho, dtype=torch.bool)
    if settings.is_correction == "tis":
        return rho.clamp(max=settings.is_cap), rho >= settings.is_cap
    if settings.is_correction == "mis":
        lower = settings.is_lower if settings.is_lower is not None else 1.0 / settings.is_cap
        outside = (rho < lower) | (rho > settings.is_cap)
        return torch.where(outside, torch.zeros_like(rho), rho), outside
    raise ValueError(f"is_correction {settings.is_correction!r}: use 'none', 'tis' or 'mis'")


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


def gspo_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO-token (module docstring): per token (-min(s A, clip(s) A), s, whether the clipped branch is taken)."""
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    log_r = logp - old_logp.detach()
    sequence = sequence_mean(log_r.detach(), mask.to(log_r.dtype))
    ratio = torch.exp((logp - logp.detach() + sequence).clamp(max=10.0))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), ratio, clipped < unclipped


def cispo_objective(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (module docstring): per token (-sg(clip(r)) A logp, r, whether the clip changed r)."""
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp((logp - old_logp.detach()).clamp(-20.0, 20.0))
    weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logp, ratio, weight != ratio.detach()


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
    is_corrected: torch.Tensor | None = None  # where the correction capped (tis) or masked (mis) the weight


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
    weight, corrected = importance_correction(old_logp, behavior_logp, mask, settings)
    is_weight = torch.where(mask, weight, zero)
    if settings.loss == "gspo":
        surrogate, ratio, clip_active = gspo_objective(
            logp, old_logp, advantages, mask, settings.clip_low, settings.clip_high
        )
    elif settings.loss == "cispo":
        surrogate, ratio, clip_active = cispo_objective(
            logp, old_logp, advantages, settings.clip_low, settings.clip_high
        )
    else:
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
        clip_active=clip_active & mask, mask=mask, is_corrected=corrected & mask,
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
