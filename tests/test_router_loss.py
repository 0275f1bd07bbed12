"""trainer.router_aux_loss_coef: the routers' load-balancing loss (steps/models/router_loss.py), checked against a
hand-computed example, masked to the real tokens, computed by the model's forward only when the coefficient is
positive, reaching the routers' gradients; and refused with frozen routers."""

from __future__ import annotations

import pytest
import torch
from experience_helpers import tiny_model

from steps.errors import MoerlError
from steps.models.router_loss import load_balancing_loss, router_probabilities
from steps.run.config import validate_config


def test_the_loss_is_E_times_the_routed_share_times_the_mean_probability():
    # 4 tokens, 4 experts, top-1: rows go to experts 0, 0, 1, 2 -> shares (1/2, 1/4, 1/4, 0)
    logits = torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1], [0.1, 0.6, 0.2, 0.1],
                                     [0.25, 0.25, 0.25, 0.25]]))  # fmt: skip
    chosen = torch.tensor([[0], [0], [1], [2]])
    mean_prob = torch.tensor([1.45, 1.25, 0.75, 0.55]) / 4
    expected = 4 * (torch.tensor([0.5, 0.25, 0.25, 0.0]) * mean_prob).sum()  # 4 * (0.18125 + 0.078125 + 0.046875)
    got = load_balancing_loss(logits, chosen, "softmax_topk", torch.ones(4, dtype=torch.bool))
    assert torch.allclose(got, expected) and abs(float(got) - 1.225) < 1e-6


def test_an_even_share_gives_one_crowding_more_and_padding_does_not_count():
    logits = torch.tensor([[2.0, 0.0, 0.0]]).repeat(6, 1)  # every token prefers expert 0
    chosen = torch.tensor([[0], [1], [2], [0], [0], [0]])
    mask = torch.tensor([True, True, True, False, False, False])  # the last three are padding
    assert torch.allclose(load_balancing_loss(logits, chosen, "softmax_topk", mask), torch.tensor(1.0))
    assert float(load_balancing_loss(logits, chosen, "softmax_topk", torch.ones(6, dtype=torch.bool))) > 1.0
    empty = load_balancing_loss(logits.requires_grad_(), chosen, "softmax_topk", torch.zeros(6, dtype=torch.bool))
    assert float(empty) == 0.0 and empty.requires_grad


def test_sigmoid_routers_use_their_scores_normalised():
    logits = torch.tensor([[2.0, 0.0, -2.0]])
    probs = router_probabilities(logits, "sigmoid_group_topk")
    assert torch.allclose(probs, logits.sigmoid() / logits.sigmoid().sum())


def test_the_model_computes_it_only_with_a_positive_coefficient_and_it_trains_the_routers():
    model = tiny_model(seed=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    model(ids, mask)
    assert model.aux_loss is None
    model.router_aux_loss_coef = 0.5
    model(ids, mask)
    assert model.aux_loss is not None and float(model.aux_loss) > 0
    model.aux_loss.backward()
    routers = model.router_parameters()
    assert routers and all(p.grad is not None and p.grad.abs().sum() > 0 for p in routers)
    assert all(block.balance_mask is None for block in model.moe_blocks())  # nothing left for the next forward


def test_a_load_balancing_loss_with_frozen_routers_is_refused():
    base = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}
    assert validate_config({**base, "trainer": {"router": "train", "router_aux_loss_coef": 0.01}})
    with pytest.raises(MoerlError, match=r"trainer.router_aux_loss_coef.*set trainer.router: train"):
        validate_config({**base, "trainer": {"router_aux_loss_coef": 0.01}})
