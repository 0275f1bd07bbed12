"""trainer.old_logprobs: "behavior" takes the PPO ratio's old policy from the rollout engine's log-probs
instead of an extra forward pass; at staleness 0 with the engine computing what the trainer does, both give
the same update, and "behavior" runs no old-logprob pass."""

from __future__ import annotations

import pytest
import torch
from experience_helpers import tiny_model
from model_helpers import response_logprobs

from pipelines.config import load_config
from steps.experience.tables import Sample
from steps.expert_parallel.mesh import Mesh
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.training.trainer import PolicyTrainer, TrainSettings


def on_policy_samples(model: MoeForCausalLM, count: int = 12) -> list[Sample]:
    """Samples whose behavior log-probs are the model's own (what the torch engine records at staleness 0)."""
    generator = torch.Generator().manual_seed(1)
    samples = []
    for i in range(count):
        prompt = torch.randint(3, model.config.vocab_size, (4,), generator=generator).tolist()
        response = torch.randint(3, model.config.vocab_size, (1 + i % 5,), generator=generator).tolist()
        logprobs = response_logprobs(model, prompt, response).tolist()
        advantage = float(torch.randn((), generator=generator))
        samples.append(Sample(f"p{i // 4}", i % 4, prompt, response, logprobs, advantage))
    return samples


def train_once(old_logprobs: str, passes: list[int]) -> dict[str, torch.Tensor]:
    model = tiny_model().train()
    samples = on_policy_samples(model)
    settings = TrainSettings(micro_batch_size=4, steps_per_epoch=3, lr=1e-2, old_logprobs=old_logprobs)
    trainer = PolicyTrainer(model, Mesh(), settings)
    original = trainer.old_logprobs

    def counted(*args, **kwargs):
        passes.append(1)
        return original(*args, **kwargs)

    trainer.old_logprobs = counted  # type: ignore[method-assign]
    metrics = trainer.train(samples, iteration=1)
    assert metrics["steps"] == 3
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_behavior_old_logprobs_skip_the_extra_pass_and_give_the_recomputed_update():
    recompute_passes: list[int] = []
    behavior_passes: list[int] = []
    recomputed = train_once("recompute", recompute_passes)
    from_engine = train_once("behavior", behavior_passes)
    assert recompute_passes == [1] and behavior_passes == []
    for name, weight in recomputed.items():
        torch.testing.assert_close(from_engine[name], weight, atol=1e-5, rtol=1e-4, msg=name)


def test_old_logprobs_is_a_config_choice_and_the_demo_uses_the_engines(tmp_path):
    cfg = load_config("configs/demo.yaml", {"sft_checkpoint": str(tmp_path), "run_store": f"file://{tmp_path}/run"})
    assert cfg.trainer.old_logprobs == "behavior" and cfg.staleness == 0
    assert TrainSettings.from_run_config(cfg).old_logprobs == "behavior"
    with pytest.raises(Exception, match="old_logprobs"):
        load_config("configs/demo.yaml", {"sft_checkpoint": str(tmp_path), "trainer.old_logprobs": "cached"})
