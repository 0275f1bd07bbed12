"""Each term of the RL objective against values computed by hand."""

import math

import pytest
import torch

from steps.training.rl_loss import (
    LossSettings,
    aggregate,
    k3_kl,
    ppo_clip_objective,
    token_entropy,
    token_terms,
)
from steps.training.rl_loss import importance_correction as correction


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_truncated_importance_weight():
    tis = LossSettings(is_cap=2.0)
    w, capped = correction(t(-1.0, -2.0, -1.0), t(-2.0, -1.0, -1.0), torch.ones(3), tis)
    # exp(1) = 2.718 is capped at 2; exp(-1) = 0.3679; equal log-probs give 1
    torch.testing.assert_close(w, t(2.0, math.exp(-1.0), 1.0))
    assert capped.tolist() == [True, False, False]
    old = torch.tensor([-1.0], requires_grad=True)
    assert not correction(old, t(-2.0), torch.ones(1), LossSettings(is_cap=5.0))[0].requires_grad  # a weight


def test_ppo_clip_with_separate_low_and_high_bounds():
    # ratio r = exp(logp - old); clip_low 0.2 -> 0.8, clip_high 0.28 -> 1.28
    ratios = t(1.5, 0.5, 0.5, 1.5, 1.1, 0.9)
    adv = t(1.0, -1.0, 1.0, -1.0, 2.0, -3.0)
    logp = torch.log(ratios).requires_grad_(True)
    loss, ratio, clipped = ppo_clip_objective(logp, torch.zeros(6), adv, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5: min(1.5, 1.28) = 1.28 (clipped above); A<0, r=0.5: min(-0.5, -0.8) = -0.8 (clipped below)
    # A>0, r=0.5: min(0.5, 0.8) = 0.5; A<0, r=1.5: min(-1.5, -1.28) = -1.5; inside the bounds: r*A
    expected = -t(1.28, -0.8, 0.5, -1.5, 2.2, -2.7)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(ratio, ratios)
    assert clipped.tolist() == [True, True, False, False, False, False]
    loss.sum().backward()
    # d(-r*A)/d logp = -r*A where unclipped; 0 where the clipped constant is taken
    torch.testing.assert_close(logp.grad, t(0.0, 0.0, -0.5, 1.5, -2.2, 2.7))


def test_clip_higher_is_asymmetric():
    logp = torch.log(t(1.25, 0.75))
    loss, _, clipped = ppo_clip_objective(logp, torch.zeros(2), t(1.0, -1.0), clip_low=0.2, clip_high=0.28)
    # 1.25 < 1.28: not clipped above; 0.75 < 0.8: clipped below
    assert clipped.tolist() == [False, True]
    torch.testing.assert_close(loss, t(-1.25, 0.8))


def test_k3_kl_estimator():
    kl = k3_kl(logp=t(-1.0, -2.0, -1.5), ref_logp=t(-2.0, -1.0, -1.5))
    # delta = ref - logp: -1 -> e^-1 + 1 - 1 = 0.3679; +1 -> e - 1 - 1 = 0.7183; 0 -> 0
    torch.testing.assert_close(kl, t(math.exp(-1.0), math.e - 2.0, 0.0))
    logp = torch.tensor([-1.0], requires_grad=True)
    k3_kl(logp, t(-2.0)).backward()
    torch.testing.assert_close(logp.grad, t(1.0 - math.exp(-1.0)))  # d/dlogp = 1 - exp(ref - logp)


def test_token_and_sequence_mean_aggregation():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # token-mean: (1+2+3+4) / 4 tokens; seq-mean: mean(6/3, 4/1) = 3
    assert float(aggregate(values, mask, "token-mean", normalizer=4)) == pytest.approx(2.5)
    assert float(aggregate(values, mask, "seq-mean", normalizer=2)) == pytest.approx(3.0)
    # a rank holding half the batch contributes its share of the global mean
    shares = [aggregate(values[i : i + 1], mask[i : i + 1], "token-mean", 4) for i in range(2)]
    assert float(sum(shares)) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(values, mask, "sum", 1)  # type: ignore[arg-type]


def test_all_terms_together_by_hand():
    # one sequence, 3 positions; the first is prompt (masked) and holds garbage that must not leak
    mask = torch.tensor([[False, True, True]])
    logp = torch.tensor([[float("nan"), math.log(0.5), math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[float("inf"), math.log(0.4), math.log(0.25)]])
    behavior = torch.tensor([[0.0, math.log(0.1), math.log(0.25)]])
    ref = torch.tensor([[0.0, math.log(0.5), math.log(0.4)]])
    settings = LossSettings(clip_low=0.2, clip_high=0.28, loss_agg="token-mean", kl_coef=0.5, is_cap=2.0)
    terms = token_terms(logp, old, behavior, torch.tensor([2.0]), mask, settings, ref)
    # token 1: r = 0.5/0.4 = 1.25 (inside 1.28), w = min(0.4/0.1, 2) = 2, pg = -2 * 1.25 * 2 = -5
    #          kl: delta = ln(0.5/0.5) = 0 -> 0
    # token 2: r = 0.2/0.25 = 0.8, w = 1, pg = -0.8 * 2 = -1.6 (A > 0: the low clip never binds)
    #          kl: delta = ln(0.4/0.2) = ln 2 -> 2 - ln 2 - 1
    kl2 = 2.0 - math.log(2.0) - 1.0
    torch.testing.assert_close(terms.pg, torch.tensor([[0.0, -5.0, -1.6]]))
    torch.testing.assert_close(terms.kl, torch.tensor([[0.0, 0.0, kl2]]))
    torch.testing.assert_close(terms.is_weight, torch.tensor([[0.0, 2.0, 1.0]]))
    torch.testing.assert_close(terms.ratio, torch.tensor([[0.0, 1.25, 0.8]]))
    loss = aggregate(terms.loss, terms.mask, "token-mean", normalizer=2)
    assert float(loss.detach()) == pytest.approx((-5.0 - 1.6 + 0.5 * kl2) / 2, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 0] == 0
    # d/dlogp of token 2: (-w*r*A + kl_coef * (1 - exp(ref - logp))) / 2 = (-1.6 + 0.5 * (1 - 2)) / 2
    assert float(logp.grad[0, 2]) == pytest.approx((-1.6 - 0.5) / 2, rel=1e-6)


def test_no_kl_term_without_a_coefficient():
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.zeros(1, 2)
    terms = token_terms(logp, logp, logp, torch.tensor([1.0]), mask, LossSettings(kl_coef=0.0), ref_logp=logp - 1)
    assert terms.kl.abs().sum() == 0
    torch.testing.assert_close(terms.loss, -torch.ones(1, 2))


def test_entropy():
    logits = torch.zeros(2, 8)
    logits[1, 0] = 1e4  # one certain token
    torch.testing.assert_close(token_entropy(logits), t(math.log(8.0), 0.0))
