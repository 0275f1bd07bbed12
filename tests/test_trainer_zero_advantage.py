"""Samples with advantage exactly 0 (every sample of their GRPO group got the same reward) have a zero
gradient when kl_coef is 0: the trainer leaves them out of the forward/backward, keeps each step's loss
normaliser, and so takes the same optimizer steps as when it runs them."""

from __future__ import annotations

import pytest
import torch
from experience_helpers import tiny_model
from model_helpers import response_logprobs

from steps.experience.tables import Sample
from steps.expert_parallel.mesh import Mesh
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.training.rl_loss import LossSettings
from steps.training.trainer import PolicyTrainer, TrainSettings, plan_steps, trained_steps


def samples_with_solved_groups(model: MoeForCausalLM) -> list[Sample]:
    """Four prompts x four samples; prompts p0 and p1 are all-equal-reward groups (advantage 0)."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for group in range(4):
        prompt = torch.randint(3, model.config.vocab_size, (4 + group,), generator=generator).tolist()
        for i in range(4):
            response = torch.randint(3, model.config.vocab_size, (1 + i % 3,), generator=generator).tolist()
            logprobs = response_logprobs(model, prompt, response).tolist()
            advantage = 0.0 if group < 2 else float(torch.randn((), generator=generator))
            samples.append(Sample(f"p{group}", i, prompt, response, logprobs, advantage))
    return samples


def train(skip: bool, **settings) -> tuple[torch.Tensor, dict, list[torch.Tensor], int]:
    """One iteration: the weights after it (flat), its metrics, the gradient each optimizer step applied
    (flat, after sync and clipping), and how many sample rows the forward passes ran."""
    torch.manual_seed(0)
    model = tiny_model().train()
    samples = samples_with_solved_groups(model)
    defaults = dict(micro_batch_size=4, steps_per_epoch=4, lr=1e-2, weight_decay=0.1, skip_zero_advantage=skip)
    trainer = PolicyTrainer(model, Mesh(), TrainSettings(**{**defaults, **settings}))
    rows, grads = [], []
    forward, optimizer_step = trainer.forward_logprobs, trainer.optimizer.step

    def counted(model, mb):
        rows.append(len(mb.sample_ids))
        return forward(model, mb)

    def recorded(*args, **kwargs):
        grads.append(flat(p.grad for p in model.parameters()))
        return optimizer_step(*args, **kwargs)

    trainer.forward_logprobs = counted  # type: ignore[method-assign]
    trainer.optimizer.step = recorded  # type: ignore[method-assign]
    metrics = trainer.train(samples, iteration=1)
    return flat(model.parameters()), metrics, grads, sum(rows)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return float((a - b).norm()) <= rel * float(b.norm())  # b = 0 (a step of solved groups only): a = 0


@pytest.mark.parametrize(
    "settings",
    [{}, {"old_logprobs": "behavior"}, {"shared_prompts": True, "steps_per_epoch": 2}, {"steps_per_epoch": 2}],
    ids=["recompute", "behavior", "shared-prompts", "an-all-zero-step"],
)
def test_zero_advantage_samples_are_not_run_and_the_update_is_the_same(settings):
    full, full_metrics, full_grads, full_rows = train(skip=False, **settings)
    skipped, metrics, grads, rows = train(skip=True, **settings)
    passes = 2 if settings.get("old_logprobs", "recompute") == "recompute" else 1  # old-logprob pass + training
    assert full_rows == 16 * passes and rows == 8 * passes
    assert metrics["zero_advantage_skipped"] == 8 and full_metrics["zero_advantage_skipped"] == 0
    assert metrics["sequences"] == 8 and metrics["steps"] == full_metrics["steps"] == len(grads) == len(full_grads)
    # the same loss (a wrong normaliser would show here: AdamW and clipping hide a gradient's scale)
    assert metrics["loss"] == pytest.approx(full_metrics["loss"], rel=1e-5)
    # the first step's gradient to float rounding; later ones from weights that differ by that rounding
    torch.testing.assert_close(grads[0], full_grads[0], atol=1e-6, rtol=1e-5)
    assert all(close(g, f, rel=1e-4) for g, f in zip(grads, full_grads, strict=True))
    # AdamW's g / sqrt(v) turns rounding on near-zero gradient entries into visible steps: compare the
    # weights as a whole, against how far the update moved them (measured: under 1e-3 of it)
    torch.manual_seed(0)
    moved = full - flat(tiny_model().parameters())
    assert close(skipped, full, rel=1e-2 * float(moved.norm() / full.norm()))


def test_a_step_with_only_zero_advantage_samples_is_still_a_step():
    model = tiny_model()
    samples = samples_with_solved_groups(model)
    plan = [list(range(8)), list(range(8, 16))]  # the first step: only the solved groups
    assert trained_steps(samples, plan, TrainSettings(steps_per_epoch=2)) == [[], list(range(8, 16))]


def test_zero_advantage_samples_are_trained_when_the_kl_penalty_gives_them_a_gradient():
    model = tiny_model()
    samples = samples_with_solved_groups(model)
    plan = plan_steps(len(samples), TrainSettings(steps_per_epoch=2), iteration=1)
    with_kl = TrainSettings(steps_per_epoch=2, loss=LossSettings(kl_coef=0.1))
    assert trained_steps(samples, plan, with_kl) == plan
    assert trained_steps(samples, plan, TrainSettings(steps_per_epoch=2, skip_zero_advantage=False)) == plan
    assert sum(map(len, trained_steps(samples, plan, TrainSettings(steps_per_epoch=2)))) == 8
