"""A multi-turn sample's loss mask through the trainer: only the model's own tokens are trained (their behaviour
log-probs, their old log-probs, the loss normaliser); the environment's tokens are context for the model's later
turns and nothing else, in the plain, shared-prompt and packed layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from experience_helpers import tiny_model
from model_helpers import response_logprobs

from steps.experience.tables import Sample
from steps.expert_parallel.mesh import Mesh
from steps.models.kernels import token_logprobs
from steps.training.micro_batch import collate, collate_groups
from steps.training.trainer import PolicyTrainer, TrainSettings

# response = model turn (3 tokens) + environment (2) + model turn (2)
MASK = np.array([1, 1, 1, 0, 0, 1, 1], dtype=bool)


def multi_turn(prompt_id: str, prompt: list[int], response: list[int], logprobs: list[float], advantage: float,
               mask: np.ndarray = MASK) -> Sample:  # fmt: skip
    # the environment's positions carry a value no engine would write, to show that nothing reads them
    behaviour = [lp if m else -7.0 for lp, m in zip(logprobs, mask, strict=True)]
    return Sample(prompt_id, 0, prompt, response, behaviour, advantage, loss_mask=mask)


def test_collate_masks_the_environments_tokens_and_keeps_the_models_logprobs():
    s = multi_turn("p", [5, 6], [10, 11, 12, 20, 21, 13, 14], [-1, -2, -3, 0, 0, -4, -5], 1.0)
    old = {0: torch.tensor([-1.5, -2.5, -3.5, -4.5, -5.5])}  # the model's 5 tokens
    for mb in (collate([s], [0], torch.device("cpu"), old_logps=old),
               collate_groups([s], [0], torch.device("cpu"), old_logps=old)):  # fmt: skip
        trained = mb.loss_mask[0]
        assert mb.targets[0][trained].tolist() == [10, 11, 12, 13, 14]
        assert mb.behavior_logp[0][trained].tolist() == [-1, -2, -3, -4, -5]
        assert mb.old_logp is not None and mb.old_logp[0][trained].tolist() == [-1.5, -2.5, -3.5, -4.5, -5.5]
        assert mb.num_response_tokens == 5


def test_a_mask_of_ones_is_the_single_turn_sample():
    plain = Sample("p", 0, [5, 6], [10, 11, 12], [-1.0, -2.0, -3.0], 0.5)
    masked = Sample("p", 0, [5, 6], [10, 11, 12], [-1.0, -2.0, -3.0], 0.5, loss_mask=np.ones(3, dtype=bool))
    a, b = collate([plain], [0], torch.device("cpu")), collate([masked], [0], torch.device("cpu"))
    assert torch.equal(a.loss_mask, b.loss_mask) and torch.equal(a.behavior_logp, b.behavior_logp)
    assert plain.num_trained_tokens == masked.num_trained_tokens == 3


def trained_gradient(settings: dict, samples_of) -> tuple[torch.Tensor, torch.Tensor]:
    """The first optimizer step's gradient, and the gradient of -sum_s A_s sum_{model tokens t} log p_t / N worked
    out directly on the model (at ratio 1, what the PPO token-mean loss differentiates to)."""
    torch.manual_seed(0)
    model = tiny_model().train()
    samples = samples_of(model)
    expected = [torch.zeros_like(p) for p in model.parameters()]
    count = sum(s.num_trained_tokens for s in samples)
    for s in samples:
        model.zero_grad()
        logits = model(torch.tensor([[*s.prompt_ids, *s.response_ids]]))[0, len(s.prompt_ids) - 1 : -1]
        logp = token_logprobs(logits.float(), torch.tensor(s.response_ids))
        (-s.advantage * logp[torch.from_numpy(s.loss_mask)].sum() / count).backward()
        expected = [e if p.grad is None else e + p.grad for e, p in zip(expected, model.parameters(), strict=True)]
    model.zero_grad()
    defaults = dict(micro_batch_size=8, steps_per_epoch=1, lr=1e-3, grad_clip=1e9, old_logprobs="behavior")
    trainer = PolicyTrainer(model, Mesh(), TrainSettings(**{**defaults, **settings}))
    grads: list[torch.Tensor] = []
    optimizer_step = trainer.optimizer.step

    def recorded(*args, **kwargs):
        grads.append(torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.detach().flatten()
                                for p in model.parameters()]))  # fmt: skip
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = recorded  # type: ignore[method-assign]
    trainer.train(samples, iteration=1)
    return grads[0], torch.cat([e.flatten() for e in expected])


def conversations(model) -> list[Sample]:
    """Two conversations of one prompt (a group), different turns and masks, behaviour log-probs the model's own."""
    prompt = [5, 6, 7, 8]
    rows = [([10, 11, 12, 20, 21, 13, 14], MASK, 1.0),
            ([15, 16, 22, 23, 24, 17, 18], np.array([1, 1, 0, 0, 0, 1, 1], dtype=bool), -1.0)]  # fmt: skip
    out = []
    for k, (response, mask, advantage) in enumerate(rows):
        logprobs = response_logprobs(model, prompt, response).tolist()
        s = multi_turn("p0", prompt, response, logprobs, advantage, mask)
        out.append(Sample(s.prompt_id, k, s.prompt_ids, s.response_ids, s.behavior_logprobs, advantage,
                          loss_mask=mask))  # fmt: skip
    return out


@pytest.mark.parametrize(
    "settings", [{}, {"shared_prompts": True}, {"sequence_packing": True}], ids=["plain", "shared-prompts", "packed"]
)
def test_the_update_trains_the_models_tokens_only(settings):
    got, expected = trained_gradient(settings, conversations)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-4)
