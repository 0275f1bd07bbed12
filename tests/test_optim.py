"""steps.training.optim.AdamW: the same bits as torch.optim.AdamW(foreach=False) (weights and state, across rate
changes and a save/load of the state between iterations), without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_update_experience import tiny_model

from steps.training.optim import AdamW
from steps.training.optimizer_state import load_optimizer_state, optimizer_state_tensors
from steps.training.trainer import TrainSettings, completed_steps, new_adamw, set_learning_rate

REPO = Path(__file__).resolve().parents[1]
SETTINGS = TrainSettings(lr=3e-2, warmup_steps=3, weight_decay=0.1, betas=(0.8, 0.95))


def torch_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """What new_adamw returned before steps.training.optim existed."""
    return torch.optim.AdamW(
        model.parameters(), lr=SETTINGS.lr, betas=SETTINGS.betas, weight_decay=SETTINGS.weight_decay, foreach=False
    )


def train(model: torch.nn.Module, optimizer, steps: range) -> list[float]:
    """Steps as PolicyTrainer.step takes them (warmup rate set before each); the batch depends on the step
    number only. At step 2 the last parameter gets no gradient: it must be skipped (weights and state)."""
    rates = []
    for n in steps:
        ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(n))
        logits = model(ids, torch.ones_like(ids))
        logits.float().pow(2).mean().backward()
        if n == 2:
            last_parameter(model).grad = None
        rates.append(set_learning_rate(optimizer, SETTINGS))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return rates


def last_parameter(model: torch.nn.Module) -> torch.nn.Parameter:
    return list(model.parameters())[-1]  # not the first: completed_steps reads the first one's count


def assert_same_bits(model_a, opt_a, model_b, opt_b) -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b), name
        state_a, state_b = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert state_a.keys() == state_b.keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for field in ("step", "exp_avg", "exp_avg_sq"):
            x, y = state_a[field], state_b[field]
            assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), f"{name}.{field}"


def test_adamw_matches_torch_adamw_bit_for_bit():
    ours_model, torch_model = tiny_model(), tiny_model()
    ours = new_adamw(ours_model, SETTINGS)
    assert isinstance(ours, AdamW)
    reference = torch_adamw(torch_model)
    start = {n: p.detach().clone() for n, p in ours_model.named_parameters()}

    rates = train(ours_model, ours, range(6))
    assert train(torch_model, reference, range(6)) == rates
    assert rates == pytest.approx([1e-2, 2e-2, 3e-2, 3e-2, 3e-2, 3e-2])  # the warmup changed the rate between steps

    assert_same_bits(ours_model, ours, torch_model, reference)
    assert completed_steps(ours) == 6
    skipped = ours.state[last_parameter(ours_model)]["step"]
    assert skipped.shape == () and skipped.dtype == torch.float32 and skipped.item() == 5  # not at step 2
    assert all(not torch.equal(start[n], p) for n, p in ours_model.named_parameters())  # it did train


def test_state_round_trip_continues_like_an_uninterrupted_run():
    uninterrupted_model = tiny_model()
    uninterrupted = new_adamw(uninterrupted_model, SETTINGS)
    train(uninterrupted_model, uninterrupted, range(7))

    # Iteration 1 takes 3 steps and saves the state; iteration 2 is a fresh optimizer that loads it.
    model = tiny_model()
    first = new_adamw(model, SETTINGS)
    train(model, first, range(3))
    saved = optimizer_state_tensors(model, first)
    assert set(saved) == {f"{n}.{f}" for n, _ in model.named_parameters() for f in ("exp_avg", "exp_avg_sq", "step")}
    second = new_adamw(model, SETTINGS)
    assert load_optimizer_state(model, second, saved) == len(list(model.parameters()))
    assert completed_steps(second) == 3
    train(model, second, range(3, 7))

    assert_same_bits(model, second, uninterrupted_model, uninterrupted)


def test_state_written_by_torch_adamw_loads_into_adamw():
    """Optimizer state files of earlier runs (torch.optim.AdamW) carry on with the same bits."""
    torch_model, ours_model = tiny_model(), tiny_model()
    reference = torch_adamw(torch_model)
    train(torch_model, reference, range(2))
    train(ours_model, torch_adamw(ours_model), range(2))
    ours = new_adamw(ours_model, SETTINGS)
    load_optimizer_state(ours_model, ours, optimizer_state_tensors(torch_model, reference))
    train(torch_model, reference, range(2, 5))
    train(ours_model, ours, range(2, 5))
    assert_same_bits(ours_model, ours, torch_model, reference)


def test_update_optimizer_does_not_import_torch_dynamo():
    program = """
import sys
import torch
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.training.trainer import TrainSettings, new_adamw
model = MoeForCausalLM(MoeConfig(
    vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, max_position_embeddings=16,
))
optimizer = new_adamw(model, TrainSettings(weight_decay=0.1))
ids = torch.arange(8).reshape(1, 8)
model(ids, torch.ones_like(ids)).float().pow(2).mean().backward()
before = model.model.embed_tokens.weight.detach().clone()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
assert not torch.equal(before, model.model.embed_tokens.weight), "the step changed nothing"
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "building and stepping the update's optimizer imported torch._dynamo"


def test_zero_grad_and_param_groups():
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = AdamW([p], lr=0.5, weight_decay=0.0)
    assert optimizer.param_groups[0]["params"] == [p] and optimizer.param_groups[0]["lr"] == 0.5
    optimizer.step()  # no gradient yet: nothing moves, no state
    assert torch.equal(p, torch.ones(3)) and optimizer.state == {}
    p.sum().backward()
    optimizer.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(3))
    optimizer.zero_grad()
    assert p.grad is None
