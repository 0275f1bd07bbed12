"""trainer.lr_schedule: after the warmup, cosine or linear down to lr x lr_final_ratio at the run's last
optimizer step (iterations x epochs x steps_per_epoch), hand-computed; constant keeps lr; the schedule follows
the optimizer's step count, so an update process that resumes mid-run continues it; TRL's counterpart for the
learning bench."""

from __future__ import annotations

import math

import pytest
import torch
from test_trainer_warmup import adam_steps

from steps.run.config import validate_config
from steps.training.optimizer_state import load_optimizer_state, optimizer_state_tensors
from steps.training.trainer import TrainSettings, warmup_lr

BASE = {"sft_checkpoint": "/tmp/sft", "run_store": "/tmp/run"}


def test_cosine_and_linear_by_hand():
    # 2 warmup steps, then 8 steps of schedule to 10 (steps 3..10): progress (step - 3) / 7
    cosine = TrainSettings(lr=1.0, warmup_steps=2, lr_schedule="cosine", lr_final_ratio=0.1, run_steps=10)
    linear = TrainSettings(lr=1.0, warmup_steps=2, lr_schedule="linear", lr_final_ratio=0.1, run_steps=10)
    got_cos = [warmup_lr(cosine, n) for n in range(12)]  # completed steps 0..11: steps 1..12
    got_lin = [warmup_lr(linear, n) for n in range(12)]
    assert got_cos[:2] == pytest.approx([0.5, 1.0]) and got_lin[:2] == pytest.approx([0.5, 1.0])
    for step in range(3, 13):
        p = min((step - 3) / 7, 1.0)
        assert got_cos[step - 1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        assert got_lin[step - 1] == pytest.approx(1.0 - 0.9 * p)
    assert got_cos[2] == pytest.approx(1.0) and got_lin[2] == pytest.approx(1.0)  # the first after the warmup
    assert got_cos[9] == pytest.approx(0.1) and got_lin[9] == pytest.approx(0.1)  # the run's last step
    assert got_cos[11] == pytest.approx(0.1)  # past the run's steps (a run extended): held at the floor
    assert [warmup_lr(TrainSettings(lr=2.0, run_steps=10), n) for n in range(3)] == [2.0, 2.0, 2.0]


def test_the_schedule_comes_from_the_run_config():
    cfg = validate_config({**BASE, "iterations": 5, "trainer": {"lr_schedule": "cosine", "lr_final_ratio": 0.2,
                                                                 "epochs": 2, "steps_per_epoch": 3}})  # fmt: skip
    settings = TrainSettings.from_run_config(cfg)
    assert (settings.lr_schedule, settings.lr_final_ratio, settings.run_steps) == ("cosine", 0.2, 30)
    with pytest.raises(Exception, match="lr_schedule"):
        validate_config({**BASE, "trainer": {"lr_schedule": "step"}})
    with pytest.raises(Exception, match="lr_final_ratio"):
        validate_config({**BASE, "trainer": {"lr_final_ratio": 1.5}})


def test_a_resumed_update_continues_the_schedule():
    settings = TrainSettings(lr=1.0, lr_schedule="linear", run_steps=6)
    model = torch.nn.Linear(2, 1)
    first = torch.optim.AdamW(model.parameters(), lr=1.0)
    used = adam_steps(model, first, settings, 3)
    second = torch.optim.AdamW(model.parameters(), lr=1.0)  # the next iteration's process
    load_optimizer_state(model, second, optimizer_state_tensors(model, first))
    used += adam_steps(model, second, settings, 3)
    assert used == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])


def test_the_trl_side_of_the_learning_bench_follows():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import learning

    from steps.errors import MoerlError

    bench = {**BASE, "prompts_per_iteration": 16, "rollout": {"num_shards": 1}}
    cfg = validate_config({**bench, "trainer": {"lr_schedule": "cosine", "lr_final_ratio": 0.1}})
    grpo = learning.grpo_settings(cfg, 3, "/tmp/out")
    assert grpo["lr_scheduler_type"] == "cosine_with_min_lr" and grpo["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    with pytest.raises(MoerlError, match="no TRL counterpart"):
        learning.grpo_settings(validate_config({**bench, "trainer": {"lr_schedule": "linear", "lr_final_ratio": 0.1}}),
                               3, "/tmp/out")  # fmt: skip
