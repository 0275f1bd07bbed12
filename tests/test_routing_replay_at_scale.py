"""Routing replay at the routing widths of the 2026 releases (Qwen3-Next and Qwen3.5-MoE: 512 experts top-10;
DeepSeek-V3 / Kimi-K2: 256-384 top-8): the torch engine records top-10 of 512 experts per token and layer in the
experience's int16 column, the trainer's forward with those routes replayed is the plain one where they are its
own choice, moved routes reach the recorded experts, and under EP=2 (the all-to-all dispatch) replay gives the
single-process update. The small models of tests/test_routing_replay.py, widened."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from experience_helpers import tiny_model
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo
from test_expert_parallel_training import sharded
from test_routing_replay import generate, own_routes, per_layer, samples_with_routes

from steps.experience.tables import _int16_lists
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import Mesh, build_mesh
from steps.models.placement import ExpertPlacement
from steps.training.rl_loss import LossSettings
from steps.training.trainer import PolicyTrainer, TrainSettings

WIDE = dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=4)


def wide_model(seed: int = 7) -> torch.nn.Module:
    return tiny_model(seed=seed, **WIDE)


def settings(micro_batch_size: int = 3, **changes) -> TrainSettings:
    base = {"micro_batch_size": micro_batch_size, "steps_per_epoch": 2, "lr": 1e-2, "loss": LossSettings(kl_coef=0.0)}
    return TrainSettings(**{**base, **changes})


def test_the_engine_records_top10_of_512_experts_in_the_int16_column():
    model = wide_model()
    requests, recorded = generate(model, record=True)
    layers = len(model.moe_blocks())
    differ = total = 0
    for request, g in zip(requests, recorded, strict=True):
        prompt = list(request.prompt_ids)
        routes = g.routed_experts
        assert routes.shape == (len(prompt) + len(g.response_ids) - 1, layers, 10) and routes.dtype == np.int16
        seen = routes[:, :, 0] >= 0
        assert (routes[seen] < 512).all() and all(len(set(row)) == 10 for row in routes[seen].tolist())
        mine = own_routes(model, prompt, g.response_ids)
        same = (np.sort(routes, -1) == np.sort(mine, -1)).all(-1)
        differ, total = differ + int((~same & seen).sum()), total + int(seen.sum())
        column = pa.chunked_array([pa.array([routes.reshape(-1)], type=pa.list_(pa.int16()))])
        assert np.array_equal(_int16_lists(column)[0], routes.reshape(-1))  # the experience's column
    assert total > 200 and differ <= 0.02 * total  # float rounding may flip a near tie among 512 scores


def train_wide(samples, replay: str, **changes) -> tuple[dict, dict[str, torch.Tensor]]:
    model = wide_model().train()
    model.router_aux_loss_coef = 0.0
    metrics = PolicyTrainer(model, Mesh(), settings(**changes, routing_replay=replay)).train(samples, iteration=1)
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_replaying_its_own_top10_of_512_is_the_plain_update_and_moved_routes_train_the_recorded_experts():
    model = wide_model()
    own = samples_with_routes(model, count=6)
    plain, replayed = train_wide(own, "none", steps_per_epoch=1), train_wide(own, "rollout", steps_per_epoch=1)
    assert replayed[0]["routing"]["replay"] is True
    assert all(torch.equal(replayed[1][n], w) for n, w in plain[1].items())
    moved = samples_with_routes(model, perturb_layer=1, count=6)
    metrics, weights = train_wide(moved, "rollout", steps_per_epoch=1)
    assert per_layer(metrics["routing"], "router_disagreement")[1] == 1.0
    before = dict(model.named_parameters())
    recorded = {int(e) for s in moved for e in np.asarray(s.routed_experts).reshape(-1, 2, 10)[:, 1].reshape(-1)}
    changed = {int(n.split(".experts.")[1].split(".")[0]) for n, w in weights.items()
               if ".layers.1.mlp.experts." in n and not torch.equal(w, before[n].detach())}  # fmt: skip
    assert changed and changed <= recorded  # only the replayed experts of layer 1 got gradients


def replay_on_ranks(rank: int, world: int, out_dir: Path) -> None:
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    full = wide_model()
    moved = samples_with_routes(full, perturb_layer=1, count=6)
    placement = ExpertPlacement.contiguous(len(full.moe_blocks()), 512, 2)
    model = sharded(full, placement, mesh.ep_rank).train()
    model.router_aux_loss_coef = 0.0
    model.set_dispatch(make_dispatch("alltoall", mesh, 512))
    PolicyTrainer(model, mesh, settings(routing_replay="rollout"), torch.optim.SGD(model.parameters(), lr=0.5)).train(
        moved, 1
    )
    save_file({n: p.detach().clone() for n, p in model.named_parameters()}, str(out_dir / f"rank{rank}.safetensors"))


def test_replay_of_top10_of_512_over_ep2_gives_the_single_process_update(tmp_path):
    run_gloo(replay_on_ranks, 2, tmp_path, timeout=300)
    full = wide_model().train()
    full.router_aux_loss_coef = 0.0
    moved = samples_with_routes(full, perturb_layer=1, count=6)
    single = dataclasses.replace(settings(routing_replay="rollout"), micro_batch_size=6)
    PolicyTrainer(full, Mesh(), single, torch.optim.SGD(full.parameters(), lr=0.5)).train(moved, 1)
    expected = {n: p.detach() for n, p in full.named_parameters()}
    for rank in range(2):
        for name, value in load_file(tmp_path / f"rank{rank}.safetensors").items():
            torch.testing.assert_close(value, expected[name], atol=2e-6, rtol=1e-5, msg=name)
