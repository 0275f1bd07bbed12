"""Each setting has one owner, its run-config section: the libraries are built from their sections by field
name, so every field of a section reaches the library's settings, whatever its value."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from steps.engines.interface import SamplingParams
from steps.engines.sglang_engine import SGLangSettings
from steps.run.config import validate_config
from steps.scoring.rewards import RewardWeights
from steps.training.rl_loss import LossSettings
from steps.training.trainer import TrainSettings

URIS = {"sft_checkpoint": "file:///sft", "run_store": "file:///run"}


def changed(section: Any, **values: Any) -> dict[str, Any]:
    """`values`, each checked to differ from the section's default (else the test would prove nothing)."""
    for name, value in values.items():
        assert getattr(section, name) != value, name
    return values


def test_every_trainer_loop_and_loss_setting_reaches_the_trainer():
    default = validate_config(URIS).trainer
    loss = changed(default, clip_low=0.1, clip_high=0.5, loss_agg="seq-mean", kl_coef=0.3, is_cap=3.0,
                   loss="gspo", is_correction="mis", is_level="sequence", is_lower=0.25)  # fmt: skip
    loop = changed(default, micro_batch_size=7, epochs=3, steps_per_epoch=5, lr=1e-3, warmup_steps=9,
                   weight_decay=0.01, betas=(0.8, 0.95), grad_clip=0.5, old_logprobs="behavior",
                   shared_prompts=True, lr_schedule="cosine", lr_final_ratio=0.1)  # fmt: skip
    cfg = validate_config({**URIS, "seed": 11, "trainer": {**loss, **loop}})
    settings = TrainSettings.from_run_config(cfg)
    assert dataclasses.asdict(settings.loss) == loss
    assert {name: getattr(settings, name) for name in loop} == loop
    assert settings.seed == 11
    # Every loss setting is a trainer config field: a LossSettings field the config lacks fails here.
    assert {f.name for f in dataclasses.fields(LossSettings)} <= set(type(default).model_fields)


def test_every_sampling_setting_reaches_the_engine():
    default = validate_config(URIS).sampling
    values = changed(default, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=12)
    cfg = validate_config({**URIS, "sampling": values, "group_size": 3})
    params = SamplingParams.from_config(cfg.sampling, [2, 5], cfg.group_size)
    assert {name: getattr(params, name) for name in values} == values
    assert (params.stop_token_ids, params.n) == ((2, 5), 3)
    assert set(type(default).model_fields) == {f.name for f in dataclasses.fields(SamplingParams)} - {
        "stop_token_ids", "n"}  # fmt: skip


def test_every_sglang_setting_reaches_the_sglang_engine():
    default = validate_config(URIS).rollout.sglang
    values = changed(default, tp_size=2, ep_size=4, moe_a2a_backend="deepep", mem_fraction=0.5)
    cfg = validate_config({**URIS, "seed": 5, "rollout": {"sglang": values}})
    settings = SGLangSettings.from_config(cfg.rollout.sglang, random_seed=cfg.seed)
    assert {name: getattr(settings, name) for name in values} == values
    assert settings.random_seed == 5 and settings.deterministic is True


@pytest.mark.parametrize("name", ["exact_match", "format", "reward_model", "reward_fn"])
def test_every_reward_weight_reaches_the_reward_sum(name):
    rewards = {"reward_model": "file:///rm"} if name == "reward_model" else {}
    if name == "reward_fn":
        rewards["reward_fn"] = "pkg.mod:fn"
    cfg = validate_config({**URIS, "rewards": {**rewards, f"{name}_weight": 0.37}})
    weights = RewardWeights.from_config(cfg.rewards)
    assert getattr(weights, name) == 0.37
    assert {f"{f.name}_weight" for f in dataclasses.fields(RewardWeights)} == {
        k for k in type(cfg.rewards).model_fields if k.endswith("_weight")}  # fmt: skip


def test_every_environment_setting_reaches_the_conversation_loop():
    from steps.environments.conversation import EnvironmentSettings

    values = {"class_path": "my_envs.calc:Env", "params": {"depth": 2}, "max_turns": 7, "max_total_tokens": 300,
              "tool_call_format": "none", "step_timeout_s": 2.5, "workers": 3}  # fmt: skip
    cfg = validate_config({**URIS, "prompt_format": "chat", "environment": values})
    assert cfg.environment is not None
    default = type(cfg.environment)(class_path="x:y")
    changed(default, **{k: v for k, v in values.items() if k != "class_path"})
    settings = EnvironmentSettings.from_config(cfg.environment)
    limits = dataclasses.asdict(settings.limits)
    got = {**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name != "limits"}, **limits}
    assert got == values
    assert set(type(cfg.environment).model_fields) == set(values)
