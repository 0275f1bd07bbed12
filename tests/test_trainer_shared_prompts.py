"""trainer.shared_prompts: the plan keeps every GRPO group whole (one optimizer step, one rank, one
micro-batch), and the update with each prompt run once equals the plain update on the same group-level plan
(SGD weights after several steps, fp32, atol 1e-5), on one rank and over EP=2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo
from test_update_experience import experience_table, tiny_model

from pipelines.config import load_config
from steps.errors import MoerlError
from steps.experience.tables import Sample
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import Mesh, build_mesh
from steps.models.placement import ExpertPlacement
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.training.micro_batch import collate_groups
from steps.training.rl_loss import LossSettings
from steps.training.trainer import (
    PolicyTrainer,
    TrainSettings,
    plan_group_steps,
    prompt_groups,
    rank_group_micro_batches,
)

PROMPTS, GROUP = 5, 3


def samples(prompts: int = PROMPTS, group: int = GROUP) -> list[Sample]:
    rows = experience_table(policy_version=0, prompts=prompts, group=group, seed=4).to_pylist()
    return [
        Sample(r["prompt_id"], r["sample_index"], r["prompt_ids"], r["response_ids"], r["behavior_logprobs"],
               r["advantage"])
        for r in rows
    ]  # fmt: skip


def settings(loss_agg: str = "token-mean", shared: bool = True, **overrides) -> TrainSettings:
    base = dict(
        loss=LossSettings(loss_agg=loss_agg, kl_coef=0.1), micro_batch_size=4, epochs=2, steps_per_epoch=3,
        grad_clip=1.0, old_logprobs="recompute", shared_prompts=shared, seed=3,
    )  # fmt: skip
    return TrainSettings(**{**base, **overrides})


def groups_of(batch: list[Sample], indices: list[int]) -> set[str]:
    return {batch[i].prompt_id for i in indices}


# -- the plan -------------------------------------------------------------------------------------------


def test_the_plan_shuffles_whole_groups_into_steps_ranks_and_micro_batches():
    batch = samples(prompts=7, group=4)
    plan = plan_group_steps(batch, settings(steps_per_epoch=2), iteration=5)
    assert plan == plan_group_steps(batch, settings(steps_per_epoch=2), iteration=5)  # deterministic
    assert plan != plan_group_steps(batch, settings(steps_per_epoch=2), iteration=6)
    assert len(plan) == 4  # 2 epochs x 2 steps
    for epoch in (plan[:2], plan[2:]):
        assert sorted(i for step in epoch for i in step) == list(range(len(batch)))  # every sample once
        assert not groups_of(batch, epoch[0]) & groups_of(batch, epoch[1])  # a group lies in one step
        assert sorted(len(groups_of(batch, step)) for step in epoch) == [3, 4]
    for step in plan:
        for world in (1, 2, 3):
            per_rank = [rank_group_micro_batches(step, batch, Mesh(r, world), 5) for r in range(world)]
            assert len({len(mbs) for mbs in per_rank}) == 1, "every rank runs as many micro-batches"
            flat = [ids for mbs in per_rank for ids in mbs]
            assert sorted(i for ids in flat for i in ids) == sorted(step)
            owners = [groups_of(batch, ids) for ids in flat]
            assert sum(len(o) for o in owners) == len(groups_of(batch, step)), "a group in one micro-batch"
            shares = [sum(len(ids) for ids in mbs) for mbs in per_rank]
            assert max(shares) - min(shares) <= 4  # near-equal: within one group (of 4 samples here)


def test_too_few_prompts_for_the_steps_is_a_clear_error():
    with pytest.raises(MoerlError, match="steps_per_epoch=6.*shared_prompts"):
        plan_group_steps(samples(), settings(steps_per_epoch=6), iteration=1)


def test_a_grouped_micro_batch_runs_each_prompt_once():
    batch = samples()
    ids = [i for group in prompt_groups(batch)[:2] for i in group]
    mb = collate_groups(batch, ids, torch.device("cpu"), pad_id=0)
    assert mb.prompt_ids is not None and mb.prompt_ids.shape[0] == 2 and mb.prompt_index.tolist() == [0] * 3 + [1] * 3
    assert mb.num_response_tokens == sum(len(batch[i].response_ids) for i in ids)
    prompt_tokens = sum(len(batch[g[0]].prompt_ids) for g in prompt_groups(batch)[:2])
    assert mb.num_real_tokens == prompt_tokens + sum(len(batch[i].response_ids) - 1 for i in ids)
    bad = [Sample(s.prompt_id, s.sample_index, [*s.prompt_ids, 9], s.response_ids, s.behavior_logprobs,
                  s.advantage) if i == 1 else s for i, s in enumerate(batch)]  # fmt: skip
    with pytest.raises(MoerlError, match="different prompt_ids"):
        collate_groups(bad, [0, 1, 2], torch.device("cpu"))


def test_shared_prompts_is_a_trainer_config_field_off_by_default(tmp_path):
    overrides = {"sft_checkpoint": str(tmp_path), "run_store": f"file://{tmp_path}/run"}
    assert TrainSettings.from_run_config(load_config("configs/demo.yaml", overrides)).shared_prompts is False
    on = load_config("configs/demo.yaml", {**overrides, "trainer.shared_prompts": "true"})
    assert on.trainer.shared_prompts is True and TrainSettings.from_run_config(on).shared_prompts is True


# -- the update -----------------------------------------------------------------------------------------


def sharded(full: MoeForCausalLM, mesh: Mesh) -> MoeForCausalLM:
    if mesh.world_size == 1:
        return full
    placement = ExpertPlacement.contiguous(len(full.moe_blocks()), full.config.num_experts, mesh.ep_size)
    model = MoeForCausalLM(full.config, placement, mesh.ep_rank)
    model.load_state_dict({k: v for k, v in full.state_dict().items() if k in model.state_dict()})
    return model


def update(mesh: Mesh, train_settings: TrainSettings, group_plan: bool = False) -> tuple[dict, dict]:
    """One iteration of train() with SGD (exact enough to compare weights) -> (weights, metrics).

    group_plan: use the shared-prompt (group-level) plan even with shared_prompts off."""
    num_experts = tiny_model().config.num_experts
    model, ref = sharded(tiny_model(0), mesh), sharded(tiny_model(7), mesh)
    if mesh.world_size > 1:
        dispatch = make_dispatch("alltoall", mesh, num_experts)
        model.set_dispatch(dispatch)
        ref.set_dispatch(dispatch)
    trainer = PolicyTrainer(model, mesh, train_settings, torch.optim.SGD(model.parameters(), lr=0.3), ref)
    if group_plan:
        trainer.plan = lambda batch, iteration: plan_group_steps(batch, train_settings, iteration)  # type: ignore[method-assign]
    metrics = trainer.train(samples(), iteration=2)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean"])
def test_shared_prompts_update_equals_the_plain_update_on_the_same_plan(loss_agg):
    plain, plain_metrics = update(Mesh(), settings(loss_agg, shared=False), group_plan=True)
    shared, shared_metrics = update(Mesh(), settings(loss_agg, shared=True))
    initial = dict(tiny_model(0).named_parameters())
    assert all(not torch.equal(plain[n], initial[n]) for n in ("lm_head.weight", "model.embed_tokens.weight"))
    for name, weight in plain.items():
        torch.testing.assert_close(shared[name], weight, atol=1e-5, rtol=0, msg=name)
    assert shared_metrics["steps"] == plain_metrics["steps"] == 6
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "entropy"):
        assert shared_metrics[key] == pytest.approx(plain_metrics[key], abs=1e-5), key
    assert shared_metrics["response_tokens"] == plain_metrics["response_tokens"]
    assert shared_metrics["tokens"] < plain_metrics["tokens"]  # each prompt ran once per step, not 3 times


def train_ranks(rank: int, world: int, out_dir: Path, loss_agg: str) -> None:
    mesh = build_mesh(rank, world, world, torch.device("cpu"))
    weights, metrics = update(mesh, settings(loss_agg, shared=True))
    weights["metrics"] = torch.tensor([metrics["loss"], metrics["response_tokens"], metrics["tokens"]])
    save_file(weights, str(out_dir / f"rank{rank}.safetensors"))


def test_ep2_with_shared_prompts_equals_ep1(tmp_path):
    """5 groups in 3 steps of 2, 2 and 1 groups: in the last step one rank trains on a padding row only."""
    (tmp_path / "ep1").mkdir()
    (tmp_path / "ep2").mkdir()
    train_ranks(0, 1, tmp_path / "ep1", "token-mean")
    run_gloo(train_ranks, 2, tmp_path / "ep2", "token-mean")
    ref = load_file(tmp_path / "ep1" / "rank0.safetensors")
    checked = set()
    for rank in range(2):
        got = load_file(tmp_path / "ep2" / f"rank{rank}.safetensors")
        torch.testing.assert_close(got["metrics"], ref["metrics"], atol=1e-5, rtol=0)
        for name, value in got.items():
            torch.testing.assert_close(value, ref[name], atol=1e-5, rtol=0, msg=name)
            checked.add(name)
    assert checked == set(ref), "every parameter is held by some rank"
