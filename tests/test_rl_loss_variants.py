"""trainer.loss (ppo, gspo, cispo) and trainer.is_correction (none, tis, mis) at trainer.is_level (token,
sequence), each against values computed by hand (the formulas of steps/training/rl_loss.py's docstring, with
their papers and the peers' code cited there); the run config carries them and refuses what does not hold."""

import math

import pytest
import torch

from steps.errors import MoerlError
from steps.run.config import validate_config
from steps.training.rl_loss import LossSettings, cispo_objective, gspo_objective, importance_correction, token_terms
from steps.training.trainer import TrainSettings


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_masked_importance_sampling_keeps_the_band_and_drops_the_rest():
    old, behavior = t(0.0, 0.0, 0.0, 0.0), t(-1.0, 0.0, 1.0, -0.5)  # rho = e, 1, 1/e, e^0.5
    mis = LossSettings(is_correction="mis", is_cap=2.0)  # band [0.5, 2]
    w, masked = importance_correction(old, behavior, torch.ones(4), mis)
    torch.testing.assert_close(w, t(0.0, 1.0, 0.0, math.exp(0.5)))
    assert masked.tolist() == [True, False, True, False]
    w, _ = importance_correction(old, behavior, torch.ones(4), LossSettings(is_correction="mis", is_lower=0.3))
    torch.testing.assert_close(w, t(0.0, 1.0, math.exp(-1), math.exp(0.5)))  # 1/e = 0.37 is inside [0.3, 2]
    w, none = importance_correction(old, behavior, torch.ones(4), LossSettings(is_correction="none"))
    assert w.tolist() == [1.0] * 4 and not none.any()


def test_the_sequence_level_weight_is_the_geometric_mean_for_every_token():
    old = t(0.0, 0.0, 0.0, 0.0, 0.0, 0.0).view(2, 3)
    behavior = t(-0.3, -0.6, 0.0, 0.0, -2.0, 9.0).view(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)  # the 9.0 is padding
    seq = LossSettings(is_level="sequence", is_cap=2.0)
    w, capped = importance_correction(old, behavior, mask, seq)
    torch.testing.assert_close(w[0], t(math.exp(0.3),) * torch.ones(3, dtype=torch.float64))  # mean log = 0.3
    torch.testing.assert_close(w[1], t(2.0, 2.0, 2.0))  # mean log 1.0: e capped at 2
    assert capped[1].all() and not capped[0].any()
    w, masked = importance_correction(old, behavior, mask, LossSettings(is_level="sequence", is_correction="mis"))
    assert w[1].tolist() == [0.0, 0.0, 0.0] and masked[1].all()  # the whole sequence leaves the gradient


def test_gspo_clips_the_sequence_ratio_and_routes_its_gradient_through_each_token():
    # one sequence of 2 tokens, log r = (0.2, 0.4): s = exp(0.3) = 1.35, A = 1, clip high 0.1 -> s clipped at 1.1
    logp = t(0.2, 0.4).view(1, 2).requires_grad_(True)
    old, mask, adv = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), t(1.0)
    loss, ratio, clipped = gspo_objective(logp, old, adv, mask, clip_low=0.1, clip_high=0.1)
    torch.testing.assert_close(ratio.detach(), torch.full((1, 2), math.exp(0.3), dtype=torch.float64))
    torch.testing.assert_close(loss.detach(), torch.full((1, 2), -1.1, dtype=torch.float64))
    assert clipped.all()
    # inside the band: d(-s A)/d logp_t = -s A for each token (s_t = sg(s) r_t / sg(r_t))
    logp = t(0.01, 0.03).view(1, 2).requires_grad_(True)
    loss, ratio, clipped = gspo_objective(logp, old, t(2.0), mask, clip_low=0.1, clip_high=0.1)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -2.0 * math.exp(0.02), dtype=torch.float64))
    assert not clipped.any()


def test_cispo_weights_each_log_prob_by_the_clipped_ratio():
    logp = t(0.5, -0.05, 0.0).requires_grad_(True)  # r = e^0.5 = 1.65, 0.95, 1
    old, adv = torch.zeros(3, dtype=torch.float64), t(1.0, -2.0, 3.0)
    loss, ratio, clipped = cispo_objective(logp, old, adv, clip_low=0.2, clip_high=0.28)
    weight = t(1.28, math.exp(-0.05), 1.0)  # 1.65 clipped at 1.28; 0.95 and 1 inside
    torch.testing.assert_close(loss.detach(), -weight * adv * logp.detach())
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -weight * adv)  # the gradient of every token, clipped or not
    assert clipped.tolist() == [True, False, False]


def test_token_terms_compose_the_correction_with_the_loss():
    logp = t(0.1, 0.2).view(1, 2)
    old = torch.zeros(1, 2, dtype=torch.float64)
    behavior = t(-1.0, 0.0).view(1, 2)  # rho = e (outside [0.5, 2]), 1
    mask = torch.ones(1, 2, dtype=torch.bool)
    settings = LossSettings(loss="cispo", is_correction="mis", clip_low=0.2, clip_high=0.28)
    terms = token_terms(logp, old, behavior, t(1.0), mask, settings)
    torch.testing.assert_close(terms.pg, t(0.0, -math.exp(0.2) * 0.2).view(1, 2))  # the first token masked out
    assert terms.is_corrected.tolist() == [[True, False]]
    default = token_terms(logp, old, behavior, t(1.0), mask, LossSettings())  # ppo with tis: today's objective
    torch.testing.assert_close(default.pg, t(-2.0 * math.exp(0.1), -math.exp(0.2)).view(1, 2))


BASE = {"sft_checkpoint": "/tmp/sft", "run_store": "/tmp/run"}


def test_the_run_config_carries_them_and_refuses_what_does_not_hold():
    cfg = validate_config({**BASE, "trainer": {"loss": "gspo", "loss_agg": "seq-mean", "clip_low": 3e-4,
                                               "clip_high": 4e-4, "is_correction": "mis", "is_level": "sequence",
                                               "is_lower": 0.5}})  # fmt: skip
    loss = TrainSettings.from_run_config(cfg).loss
    assert (loss.loss, loss.is_correction, loss.is_level, loss.is_lower) == ("gspo", "mis", "sequence", 0.5)
    with pytest.raises(MoerlError, match="trainer.loss: gspo's ratio is a sequence's"):
        validate_config({**BASE, "trainer": {"loss": "gspo"}})
    with pytest.raises(MoerlError, match="trainer.is_lower: 3.0 is not below is_cap 2.0"):
        validate_config({**BASE, "trainer": {"is_lower": 3.0}})
    with pytest.raises(MoerlError, match="loss"):
        validate_config({**BASE, "trainer": {"loss": "grpo"}})
