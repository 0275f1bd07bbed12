"""The learning-rate warmup: a linear ramp over the run's first optimizer steps, carried across iterations by
the optimizer state (AdamW's step count), not restarted by each update process."""

from __future__ import annotations

import pytest
import torch

from steps.run.config import validate_config
from steps.training.optimizer_state import load_optimizer_state, optimizer_state_tensors
from steps.training.trainer import TrainSettings, completed_steps, set_learning_rate, warmup_lr


def test_warmup_ramps_linearly_then_holds():
    settings = TrainSettings(lr=1e-3, warmup_steps=4)
    assert [warmup_lr(settings, n) for n in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert warmup_lr(TrainSettings(lr=1e-3), 0) == 1e-3  # warmup_steps 0: the plain learning rate


def test_warmup_steps_come_from_the_run_config():
    cfg = validate_config({"sft_checkpoint": "/tmp/sft", "run_store": "/tmp/run", "trainer": {"warmup_steps": 12}})
    assert TrainSettings.from_run_config(cfg).warmup_steps == 12
    with pytest.raises(Exception, match="warmup_steps"):
        validate_config({"sft_checkpoint": "/tmp/sft", "run_store": "/tmp/run", "trainer": {"warmup_steps": -1}})


def adam_steps(model: torch.nn.Linear, optimizer: torch.optim.Optimizer, settings: TrainSettings, n: int) -> list:
    """Take n steps, setting the rate as PolicyTrainer.step does; returns the rate of each."""
    used = []
    for _ in range(n):
        model(torch.ones(1, 2)).sum().backward()
        used.append(set_learning_rate(optimizer, settings))
        optimizer.step()
        optimizer.zero_grad()
    return used


def test_the_ramp_continues_in_the_next_iterations_optimizer():
    settings = TrainSettings(lr=1.0, warmup_steps=4)
    model = torch.nn.Linear(2, 1)
    first = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    assert completed_steps(first) == 0
    assert adam_steps(model, first, settings, 2) == [0.25, 0.5]
    # The next iteration's update process: a fresh optimizer that loads the saved state.
    second = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    load_optimizer_state(model, second, optimizer_state_tensors(model, first))
    assert completed_steps(second) == 2
    assert adam_steps(model, second, settings, 3) == [0.75, 1.0, 1.0]
