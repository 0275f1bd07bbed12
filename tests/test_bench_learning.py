"""bench/learning.py: the moerl config -> GRPOConfig mapping, the reward, and time-to-target on synthetic curves.

The slow test runs TRL's GRPOTrainer for real (one iteration on a tiny checkpoint); it needs the `bench`
extra (trl, accelerate, datasets) and skips cleanly without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steps.demo.char_tokenizer import EOS_ID, build_tokenizer, encode
from steps.errors import MoerlError
from steps.experience.rollout_plan import iteration_prompts
from steps.scoring.rewards import RewardWeights, combine

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "learning.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_learning", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


learning = _load_bench()


@pytest.fixture
def cfg(tmp_path):
    return learning.demo_config(tmp_path / "sft", tmp_path / "run")


def _with_trainer(cfg, **fields):
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=fields)})


def optimizer_steps_per_generation(grpo: dict) -> float:
    """What TRL does with these fields: generate every steps_per_generation x num_iterations micro-batches,
    step the optimizer every gradient_accumulation_steps of them."""
    steps_per_generation = grpo["generation_batch_size"] // grpo["per_device_train_batch_size"]
    return steps_per_generation * grpo["num_iterations"] / grpo["gradient_accumulation_steps"]


def test_grpo_settings_match_the_demo_config(cfg):
    grpo = learning.grpo_settings(cfg, iterations=3, output_dir="/tmp/out")
    t, s = cfg.trainer, cfg.sampling
    samples = cfg.prompts_per_iteration * cfg.group_size
    assert grpo["num_generations"] == cfg.group_size
    assert grpo["generation_batch_size"] == samples
    assert grpo["generation_batch_size"] // grpo["num_generations"] == cfg.prompts_per_iteration
    assert (grpo["temperature"], grpo["top_p"], grpo["top_k"]) == (s.temperature, s.top_p, s.top_k)
    assert grpo["max_completion_length"] == s.max_new_tokens
    # one optimizer step trains on the same number of sequences as a moerl step
    assert grpo["per_device_train_batch_size"] * grpo["gradient_accumulation_steps"] == samples // t.steps_per_epoch
    assert optimizer_steps_per_generation(grpo) == t.epochs * t.steps_per_epoch
    assert grpo["max_steps"] == 3 * t.epochs * t.steps_per_epoch
    assert grpo["num_iterations"] == t.epochs
    assert grpo["learning_rate"] == t.lr
    assert (grpo["adam_beta1"], grpo["adam_beta2"]) == tuple(t.betas)
    assert grpo["weight_decay"] == t.weight_decay and grpo["max_grad_norm"] == t.grad_clip
    assert (grpo["epsilon"], grpo["epsilon_high"]) == (t.clip_low, t.clip_high)
    assert grpo["beta"] == t.kl_coef
    assert grpo["loss_type"] == {"token-mean": "dapo", "seq-mean": "grpo"}[t.loss_agg]
    assert grpo["scale_rewards"] == ("group" if cfg.rewards.normalize_std else "none")
    assert grpo["seed"] == cfg.seed
    # fp32 CPU training without activation recomputation, like moerl's update (TRL defaults differ)
    assert grpo["use_cpu"] and not grpo["bf16"] and not grpo["gradient_checkpointing"]
    assert grpo["router_aux_loss_coef"] == 0.0 and grpo["report_to"] == "none"
    assert grpo["lr_scheduler_type"] == "constant_with_warmup" and grpo["warmup_steps"] == t.warmup_steps == 8
    assert grpo["shuffle_dataset"] is False


def test_grpo_settings_follow_a_changed_recipe(cfg):
    changed = _with_trainer(cfg, lr=5e-5, epochs=2, steps_per_epoch=4, loss_agg="seq-mean", kl_coef=0.01,
                            clip_high=0.3, micro_batch_size=16)  # fmt: skip
    rewards = cfg.rewards.model_copy(update={"normalize_std": False})
    changed = changed.model_copy(update={"prompts_per_iteration": 32, "group_size": 4, "rewards": rewards})
    grpo = learning.grpo_settings(changed, iterations=5, output_dir="/tmp/out")
    assert grpo["learning_rate"] == 5e-5 and grpo["beta"] == 0.01 and grpo["epsilon_high"] == 0.3
    assert grpo["loss_type"] == "grpo" and grpo["scale_rewards"] == "none"
    assert grpo["generation_batch_size"] == 128 and grpo["num_generations"] == 4
    assert grpo["per_device_train_batch_size"] * grpo["gradient_accumulation_steps"] == 128 // 4
    assert grpo["per_device_train_batch_size"] <= 16 * 2  # micro_batch_size x ranks, as moerl's forward passes
    assert optimizer_steps_per_generation(grpo) == 2 * 4
    assert grpo["max_steps"] == 5 * 8


def test_settings_that_trl_cannot_follow_are_refused_or_flagged(cfg):
    assert learning.unmapped_trainer_fields(cfg) == []
    with pytest.raises(MoerlError, match="steps_per_epoch"):
        learning.grpo_settings(_with_trainer(cfg, steps_per_epoch=3), iterations=1, output_dir="/tmp/out")
    with pytest.raises(MoerlError, match="no routing replay"):
        learning.grpo_settings(_with_trainer(cfg, routing_replay="rollout"), iterations=1, output_dir="/tmp/out")
    dynamic = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"dynamic_sampling": True})})
    with pytest.raises(MoerlError, match="no dynamic sampling"):
        learning.grpo_settings(dynamic, iterations=1, output_dir="/tmp/out")
    with_rm = cfg.model_copy(update={"rewards": cfg.rewards.model_copy(update={"reward_model": "/tmp/rm"})})
    with pytest.raises(MoerlError, match="reward_model"):
        learning.grpo_settings(with_rm, iterations=1, output_dir="/tmp/out")


def test_settings_table_shows_both_sides(cfg):
    grpo = learning.grpo_settings(cfg, iterations=2, output_dir="/tmp/out")
    rows = {name: (ours, theirs) for name, ours, theirs in learning.settings_rows(cfg, grpo, 2)}
    assert rows["max new tokens"] == (str(cfg.sampling.max_new_tokens),) * 2
    assert rows["clip low / high"][0] == rows["clip low / high"][1]
    assert "NOT MAPPED" not in learning.format_table(list((k, *v) for k, v in rows.items()))


def test_the_trl_config_accepts_the_mapping(cfg, tmp_path):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    grpo = GRPOConfig(**learning.grpo_settings(cfg, iterations=2, output_dir=str(tmp_path)))
    t = cfg.trainer
    assert grpo.steps_per_generation * grpo.num_iterations / grpo.gradient_accumulation_steps == (
        t.epochs * t.steps_per_epoch
    )
    assert grpo.generation_batch_size == cfg.prompts_per_iteration * cfg.group_size
    assert grpo.epsilon_high == t.clip_high and grpo.scale_rewards == "group" and grpo.beta == 0.0


def test_time_to_target_on_a_synthetic_curve():
    points = [(30.0, 0.58), (0.0, 0.40), (10.0, 0.52), (20.0, 0.61), (40.0, 0.70)]  # out of order on purpose
    assert learning.time_to_target(points, 0.6) == 20.0
    assert learning.time_to_target(points, 0.61) == 20.0  # reaching the target exactly counts
    assert learning.time_to_target(points, 0.4) == 0.0
    assert learning.time_to_target(points, 0.75) is None
    assert learning.time_to_target([], 0.5) is None
    curve = learning.Curve("x", sorted(points))
    assert curve.best == 0.70 and curve.time_to(0.65) == 40.0


def test_moerl_curve_takes_evaluations_off_the_clock():
    start = 1000.0
    published = {0: 1001.0, 1: 1100.0, 2: 1150.0, 3: 1200.0}
    heldout = {0: 0.40, 1: 0.50, 2: 0.65, 3: 0.70}  # v3's accuracy came from score[4]
    score_finished = {1: 1050.0, 2: 1130.0, 3: 1180.0, 4: 1230.0}
    evals = {j: 5.0 for j in score_finished}
    curve = learning.moerl_curve(start, published, heldout, score_finished, evals)
    # v(i) is charged the evaluations of score[1..i], the ones that finished before it was published
    assert curve.points == [(0.0, 0.40), (95.0, 0.50), (140.0, 0.65), (185.0, 0.70)]
    assert curve.time_to(0.6) == 140.0
    assert curve.iteration_seconds == [45.0, 45.0]  # v1->v2, v2->v3; v0->v1 includes the workflow's start
    # a version whose accuracy is known but whose publication was not seen is left out, not guessed
    partial = learning.moerl_curve(start, {1: 1100.0}, {0: 0.4, 1: 0.5, 2: 0.6}, {}, {})
    assert partial.points == [(0.0, 0.4), (100.0, 0.5)]


def test_status_times_reads_succeeded_step_nodes():
    status = {
        "nodes": {
            "a": {"displayName": "publish-1", "phase": "Succeeded", "finishedAt": "2026-11-30T03:20:00Z"},
            "b": {"displayName": "publish-2", "phase": "Failed", "finishedAt": "2026-11-30T03:21:00Z"},
            "c": {"displayName": "publish-2(0)", "phase": "Succeeded", "finishedAt": "2026-11-30T03:21:00Z"},
            "d": {"displayName": "score-1", "phase": "Succeeded", "finishedAt": "2026-11-30T03:19:30Z"},
        }
    }
    published = learning.status_times(status, "publish")
    assert list(published) == [1]
    assert learning.status_times(status, "score")[1] - published[1] == -30.0


def test_trl_reward_is_moerls_verifier_reward(cfg):
    tok = build_tokenizer()
    reward = learning.VerifierReward(cfg)
    task = iteration_prompts(cfg, 1)[0].task  # the canonical name, e.g. addition3
    answers = ["357", "357", "357", "357"]
    completions = [
        [*encode(tok, "357"), EOS_ID],  # right and ended
        [*encode(tok, "358"), EOS_ID],  # wrong digits, well formed
        [*encode(tok, "357")],  # never ended: neither
        [*encode(tok, "357"), EOS_ID],
    ]
    got = reward(prompts=[""] * 4, completions=[""] * 4, completion_ids=completions, task=[task] * 4, answer=answers,
                 prompt_id=["p"] * 4, trainer_state=None)  # fmt: skip
    weights = RewardWeights.from_config(cfg.rewards)
    assert got == pytest.approx(list(combine([True, False, False, True], [True, True, False, True], None, weights)))
    assert got[0] == pytest.approx(1.1) and got[1] == pytest.approx(0.1) and got[2] == 0.0


def test_trl_prompts_are_moerls_prompt_stream(cfg):
    data = learning.prompt_dataset(cfg, 2)
    expected = iteration_prompts(cfg, 1) + iteration_prompts(cfg, 2)
    assert data["prompt_id"] == [p.prompt_id for p in expected]
    assert data["prompt"] == [p.text for p in expected] and data["answer"] == [p.answer for p in expected]


@pytest.mark.slow
def test_trl_worker_trains_and_evaluates_for_real(tmp_path):
    pytest.importorskip("trl")
    from tests.experience_helpers import tiny_model, write_checkpoint

    sft = write_checkpoint(tiny_model(), tmp_path / "sft")
    cfg = learning.demo_config(sft, tmp_path / "run").model_copy(
        update={"prompts_per_iteration": 4, "group_size": 2, "heldout_size": 8}
    )
    cfg = _with_trainer(cfg, steps_per_epoch=1, micro_batch_size=4)
    spec = {
        "config": cfg.model_dump(mode="json"), "sft": str(sft), "iterations": 2, "target": 2.0, "time_limit": 600,
        "keep_going": False, "threads": 1, "output_dir": str(tmp_path / "out"), "out": str(tmp_path / "curve.json"),
        "experts_implementation": None, "start": time.time(),
    }  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, str(BENCH), "--trl-worker", str(tmp_path / "spec.json")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "curve.json").read_text())
    assert len(result["points"]) == 3  # the SFT checkpoint, then after each of the 2 iterations
    assert all(0.0 <= acc <= 1.0 for _, acc in result["points"])
    assert [t for t, _ in result["points"]] == sorted(t for t, _ in result["points"])
    assert len(result["iteration_seconds"]) == 2 and result["stopped"] == "all iterations done"
