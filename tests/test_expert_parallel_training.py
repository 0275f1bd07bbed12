"""EP=2 over two gloo processes against EP=1 on the same global batch, through the whole policy model and the
PPO objective (clip, truncated IS, k3 KL to a reference policy): the same loss, the same gradients (fp32,
atol 1e-5) and, after one plain SGD step, the same weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo
from test_update_experience import experience_table, tiny_model

from steps.experience.tables import Sample
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import all_reduce_sum, build_mesh, sync_gradients
from steps.models.placement import ExpertPlacement, is_expert_param
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.training.micro_batch import collate
from steps.training.rl_loss import LossSettings
from steps.training.trainer import PolicyTrainer, TrainSettings, rank_micro_batches

MICRO_BATCH = 3


def samples() -> list[Sample]:
    t = experience_table(policy_version=0, prompts=3, group=3, seed=4).to_pylist()
    return [
        Sample(r["prompt_id"], r["sample_index"], r["prompt_ids"], r["response_ids"], r["behavior_logprobs"],
               r["advantage"])
        for r in t
    ]  # fmt: skip


def old_logprobs(batch: list[Sample]) -> dict[int, torch.Tensor]:
    """Fixed 'policy before the update' log-probs, so that ratios differ from 1 and some get clipped."""
    rng = random.Random(11)
    return {
        i: torch.tensor([lp + rng.uniform(-0.5, 2.5) for lp in s.behavior_logprobs]) for i, s in enumerate(batch)
    }


def sharded(full: MoeForCausalLM, placement: ExpertPlacement | None, ep_rank: int = 0) -> MoeForCausalLM:
    model = MoeForCausalLM(full.config, placement, ep_rank)
    model.load_state_dict({k: v for k, v in full.state_dict().items() if k in model.state_dict()})
    return model


def train_once(
    rank: int, world: int, out_dir: Path, ep: int, loss_agg: str, slots: list[list[int]] | None = None
) -> None:
    """One SGD step of the PPO objective on this rank's share; writes grads, weights and the loss.
    slots: the expert placement (per MoE layer, the expert ids in slot order; default contiguous)."""
    mesh = build_mesh(rank, world, ep, torch.device("cpu"))
    num_experts = tiny_model().config.num_experts
    num_layers = len(tiny_model().moe_blocks())
    placement = (
        ExpertPlacement.contiguous(num_layers, num_experts, ep) if slots is None
        else ExpertPlacement.from_lists(slots, ep)
    )  # fmt: skip
    model = sharded(tiny_model(0), placement, mesh.ep_rank)
    ref = sharded(tiny_model(7), placement, mesh.ep_rank)
    dispatch = make_dispatch("alltoall", mesh, num_experts)
    model.set_dispatch(dispatch)
    ref.set_dispatch(dispatch)
    settings = TrainSettings(
        loss=LossSettings(clip_low=0.2, clip_high=0.28, loss_agg=loss_agg, kl_coef=0.1, is_cap=2.0),
        micro_batch_size=MICRO_BATCH, grad_clip=0.0,
    )  # fmt: skip
    trainer = PolicyTrainer(model, mesh, settings, torch.optim.SGD(model.parameters(), lr=0.5), ref)
    batch = samples()
    everything = list(range(len(batch)))
    micro = [
        collate(batch, ids, mesh.device, old_logps=old_logprobs(batch))
        for ids in rank_micro_batches(everything, mesh, MICRO_BATCH)
    ]
    local = trainer.backward_step(micro, trainer.normalizer(batch, everything))
    stats = all_reduce_sum(local[:10], mesh)
    sync_gradients(model, mesh)
    out = {f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()}
    trainer.optimizer.step()
    out.update({f"weight.{n}": p.detach().clone() for n, p in model.named_parameters()})
    out["stats"] = stats.float()
    save_file(out, str(out_dir / f"rank{rank}.safetensors"))


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean"])
def test_ep2_equals_ep1_on_the_same_global_batch(tmp_path, loss_agg):
    (tmp_path / "ep1").mkdir()
    (tmp_path / "ep2").mkdir()
    train_once(0, 1, tmp_path / "ep1", 1, loss_agg)
    run_gloo(train_once, 2, tmp_path / "ep2", 2, loss_agg)
    ref = load_file(tmp_path / "ep1" / "rank0.safetensors")
    ranks = [load_file(tmp_path / "ep2" / f"rank{r}.safetensors") for r in range(2)]

    loss, clipped, tokens = ref["stats"][0], ref["stats"][3], ref["stats"][7]
    assert 0 < clipped < tokens, "the batch should have clipped and unclipped tokens"
    assert ref["stats"][2] > 0, "the KL term should be non-zero"
    for got in ranks:
        torch.testing.assert_close(got["stats"][0], loss, atol=1e-5, rtol=0)
        torch.testing.assert_close(got["stats"][3], clipped, atol=0, rtol=0)

    checked = set()
    for got in ranks:
        for key, value in got.items():
            if key == "stats":
                continue
            torch.testing.assert_close(value, ref[key], atol=1e-5, rtol=0, msg=key)
            checked.add(key)
    assert checked == set(ref) - {"stats"}, "every parameter's gradient and weight is held by some rank"
    expert_keys = {k for k in ranks[1] if is_expert_param(k)}
    assert expert_keys and all(".experts.2." in k or ".experts.3." in k for k in expert_keys)
    initial = tiny_model(0).state_dict()
    moved = {k[7:] for k in ref if k.startswith("weight.") and not torch.equal(ref[k], initial[k[7:]])}
    assert any(is_expert_param(k) for k in moved) and "lm_head.weight" in moved  # the step did something
