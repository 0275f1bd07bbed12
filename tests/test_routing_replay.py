"""Routing replay (trainer.routing_replay: rollout) and the routers' disagreement with the engine: the torch engine
records the experts its routers chose for every token it ran; the experience carries them; the trainer compares
its routers' choice with them per MoE layer and, with replay, routes each token to the recorded experts, its
routers still weighing them (as slime's, Miles' and Megatron-Core's replay gathers the router's scores at the
replayed ids); the routes follow the tokens through every micro-batch layout, activation checkpointing and the
expert-parallel dispatch."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from experience_helpers import tiny_model
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo
from test_expert_parallel_training import sharded
from test_sequence_packing import tiny_models

from steps.engines.interface import GenerationRequest, SamplingParams
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.experience.tables import Sample, _int16_lists
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import Mesh, build_mesh
from steps.models.placement import ExpertPlacement
from steps.training.micro_batch import collate, collate_groups
from steps.training.rl_loss import LossSettings
from steps.training.routes import check_routes
from steps.training.trainer import PolicyTrainer, TrainSettings


def per_layer(routing: dict, key: str) -> list:
    """The update's routing figure `key` of each MoE layer, in layer order."""
    return [routing["layers"][index][key] for index in sorted(routing["layers"], key=int)]


def generate(model, record: bool, max_new_tokens: int = 10):
    engine = TorchEngine(model, record_routes=record)
    prompts = [("a", (5, 9, 12)), ("b", (7,)), ("c", (3, 4, 5, 6, 8, 10))]
    requests = [GenerationRequest(pid, ids, k, seed=100 * i + k) for i, (pid, ids) in enumerate(prompts)
                for k in range(4)]  # fmt: skip
    return requests, engine.generate(requests, SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(2,)))


def own_routes(model, prompt: list[int], response: list[int]) -> np.ndarray:
    """[len(prompt) + len(response) - 1, MoE layers, k]: what the model's routers choose over prompt + response[:-1]
    in one forward."""
    chosen = []
    blocks = model.moe_blocks()
    originals = [block.choose for block in blocks]
    for block, original in zip(blocks, originals, strict=True):
        def choose(hidden, original=original):
            out = original(hidden)
            chosen.append(out[2])
            return out

        block.choose = choose
    try:
        with torch.no_grad():
            model(torch.tensor([prompt + response[:-1]]))
    finally:
        for block in blocks:
            del block.choose
    return torch.stack(chosen, dim=1).numpy().astype(np.int16)


def test_the_torch_engine_records_the_experts_its_routers_chose_without_changing_a_sample():
    model = tiny_model()
    requests, plain = generate(model, record=False)
    _, recorded = generate(model, record=True)
    assert [(g.response_ids, g.logprobs) for g in plain] == [(g.response_ids, g.logprobs) for g in recorded]
    assert all(g.routed_experts is None for g in plain)
    assert len({len(g.response_ids) for g in recorded}) > 2  # samples of several lengths (some stopped)
    layers, k = len(model.moe_blocks()), model.config.num_experts_per_tok
    differ = total = 0
    for request, g in zip(requests, recorded, strict=True):
        prompt = list(request.prompt_ids)
        routes = g.routed_experts
        assert routes.dtype == np.int16 and routes.shape == (len(prompt) + len(g.response_ids) - 1, layers, k)
        # The engine runs only each prompt's last position through the last layer's MLP: none recorded there
        assert (routes[: len(prompt) - 1, -1] == -1).all() and (routes[len(prompt) - 1 :, -1] >= 0).all()
        assert (routes[:, :-1] >= 0).all()
        mine = own_routes(model, prompt, g.response_ids)
        seen = routes[:, :, 0] >= 0
        same = (np.sort(routes, -1) == np.sort(mine, -1)).all(-1)
        differ, total = differ + int((~same & seen).sum()), total + int(seen.sum())
    # The same positions and layers as the trainer's forward: a misplaced token would disagree about half the time;
    # the engine's arithmetic differs from the forward's only by float rounding, which may flip a near tie.
    assert total > 200 and differ <= 0.01 * total


def moe_block():
    model = tiny_model(seed=3)
    return model.moe_blocks()[0]


def test_replay_routes_each_token_to_the_recorded_experts_weighed_by_its_router():
    block = moe_block()
    hidden = torch.randn(6, block.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    routes = torch.tensor([[0, 1], [3, 2], [1, 3], [-1, -1], [2, 0], [0, 3]])
    block.engine_routes, block.replay_routes = routes, True
    out = block(hidden)
    logits = block.gate(hidden.detach())
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    own = torch.topk(probs, 2, dim=-1)[1]
    for t in range(6):
        ids = routes[t] if routes[t, 0] >= 0 else own[t]  # -1: not recorded, the router chooses
        weights = probs[t, ids] / probs[t, ids].sum()  # norm_topk_prob: the softmax over the replayed experts
        row = hidden[t : t + 1].detach()
        expected = sum(w * block.experts[str(int(e))](row)[0] for w, e in zip(weights, ids, strict=True))
        torch.testing.assert_close(out[t], expected, atol=1e-6, rtol=1e-5)
    out.sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0  # the router still learns
    # Replaying the router's own choice is the plain forward, bit for bit
    block.engine_routes = own
    replayed = block(hidden.detach())
    block.engine_routes = None
    assert torch.equal(replayed, block(hidden.detach()))


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_every_router_kind_weighs_its_own_choice_as_it_routes(family):
    model = tiny_models()[family]
    block = model.moe_blocks()[0]
    hidden = torch.randn(9, block.hidden_size, generator=torch.Generator().manual_seed(1))
    logits, scores, own = block.choose(hidden)
    assert torch.equal(block.weigh(logits, scores, own, hidden.dtype), block.route(hidden)[2])
    other = torch.roll(own, 1, dims=0)
    block.engine_routes, block.replay_routes = other, True
    block.route_disagreement = torch.zeros(3, dtype=torch.int64)
    assert torch.equal(block.recorded_choice(own), other)
    differ = (own.sort(-1).values != other.sort(-1).values).any(-1).sum()
    assert block.route_disagreement.tolist() == [int(differ), 0, 9]  # the routers differ; the experts used do not


def samples_with_routes(model, perturb_layer: int | None = None, count: int = 12) -> list[Sample]:
    """Samples whose routes are the model's own, or with one MoE layer's routes moved to other experts."""
    rng = random.Random(5)
    out = []
    for i in range(count):
        group = random.Random(i // 3)  # the samples of a prompt id share its prompt
        prompt = [group.randrange(3, model.config.vocab_size) for _ in range(2 + (i // 3) % 3)]
        response = [rng.randrange(3, model.config.vocab_size) for _ in range(1 + i % 5)]
        routes = own_routes(model, prompt, response)
        if perturb_layer is not None:
            routes[:, perturb_layer] = (routes[:, perturb_layer] + 1) % model.config.num_experts
        logprobs = [rng.uniform(-4.0, -0.5) for _ in response]
        out.append(Sample(f"p{i // 3}", i % 3, prompt, response, logprobs, rng.uniform(-1, 1), routes.reshape(-1)))
    return out


def train(samples: list[Sample], replay: str, **settings) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    model = tiny_model(seed=7).train()
    model.router_aux_loss_coef = 0.0
    model.count_routed_rows()
    activation_checkpointing = settings.pop("activation_checkpointing", False)
    model.activation_checkpointing = activation_checkpointing
    base = dict(micro_batch_size=3, steps_per_epoch=2, lr=1e-2, loss=LossSettings(kl_coef=0.0))
    trainer = PolicyTrainer(model, Mesh(), TrainSettings(**{**base, **settings}, routing_replay=replay))
    metrics = trainer.train(samples, iteration=1)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return metrics, weights, model.routed_rows()


def test_the_update_reports_its_routers_disagreement_per_layer():
    model = tiny_model(seed=7)
    agreed, *_ = train(samples_with_routes(model), "none")
    assert agreed["routing"]["disagreement"] == 0.0 and agreed["routing"]["replay"] is False
    layer_tokens = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples_with_routes(model))
    assert per_layer(agreed["routing"], "tokens") == [layer_tokens] * len(model.moe_blocks())
    moved, *_ = train(samples_with_routes(model, perturb_layer=1), "none")
    assert per_layer(moved["routing"], "disagreement") == [0.0, 1.0]
    assert per_layer(moved["routing"], "router_disagreement") == [0.0, 1.0]  # no replay: the routers' experts
    assert moved["routing"]["disagreement"] == 0.5
    unrecorded = [dataclasses.replace(s, routed_experts=None) for s in samples_with_routes(model)]
    assert train(unrecorded, "none")[0]["routing"] is None


def test_replay_trains_through_the_recorded_experts():
    model = tiny_model(seed=7)
    own = samples_with_routes(model)
    # Replaying the routers' own choice is the plain update, bit for bit (one step: a second one's weights have
    # moved from those that chose the routes)
    plain, replayed = train(own, "none", steps_per_epoch=1), train(own, "rollout", steps_per_epoch=1)
    assert replayed[0]["routing"]["replay"] is True
    for name, weight in plain[1].items():
        assert torch.equal(replayed[1][name], weight), name
    plain = train(own, "none")
    moved = samples_with_routes(model, perturb_layer=1)
    without, with_replay = train(moved, "none"), train(moved, "rollout")
    assert all(torch.equal(without[1][n], w) for n, w in plain[1].items())  # recorded but not replayed: no effect
    assert any(not torch.equal(with_replay[1][n], w) for n, w in plain[1].items())
    # Every forward routed layer 1's tokens to the recorded experts: the routed rows count them (a packed row has
    # no padding, which the routers route themselves)
    packed = train(moved, "rollout", sequence_packing=True)
    counts = torch.zeros(model.config.num_experts, dtype=torch.int64)
    for s in moved:
        layer_1 = s.routed_experts.reshape(-1, 2, model.config.num_experts_per_tok)[:, 1].astype(np.int64)
        counts += torch.bincount(torch.from_numpy(layer_1).reshape(-1), minlength=model.config.num_experts)
    forwards = packed[2][1].sum() // counts.sum()
    assert forwards >= 2 and torch.equal(packed[2][1], counts * forwards)
    # Activation checkpointing reruns each layer in the backward with the same replayed routes: the same bits
    checkpointed = train(moved, "rollout", activation_checkpointing=True)
    for name, weight in with_replay[1].items():
        assert torch.equal(checkpointed[1][name], weight), name


@pytest.mark.parametrize("layout", ["packed", "shared_prompts"])
def test_the_routes_follow_the_tokens_in_every_micro_batch_layout(layout):
    model = tiny_model(seed=7)
    moved = samples_with_routes(model, perturb_layer=0)
    padded = train(moved, "rollout")
    other = train(moved, "rollout", **{"sequence_packing" if layout == "packed" else "shared_prompts": True})
    # Layer 0's routes all moved; layer 1's routers then see other hidden states than the engine's (what replaying
    # layer 0 does), the same over the same tokens
    assert per_layer(other[0]["routing"], "router_disagreement")[0] == 1.0
    assert per_layer(other[0]["routing"], "disagreement") == [0.0, 0.0]  # the forward used the engine's experts
    if layout == "packed":
        assert per_layer(other[0]["routing"], "router_disagreement") == pytest.approx(
            per_layer(padded[0]["routing"], "router_disagreement"), abs=0.02
        )
    else:  # each prompt's tokens once
        prompts = {s.prompt_id: len(s.prompt_ids) for s in moved}
        tokens = sum(prompts.values()) + sum(len(s.response_ids) - 1 for s in moved)
        assert per_layer(other[0]["routing"], "tokens") == [tokens, tokens]
    if layout == "packed":  # the same sums over other shapes: float32 rounding (which Adam's first steps amplify)
        assert other[0]["grad_norms"] == pytest.approx(padded[0]["grad_norms"], rel=1e-5)
        for name, weight in padded[1].items():
            torch.testing.assert_close(other[1][name], weight, atol=1e-3, rtol=1e-3, msg=name)
    grouped = collate_groups(moved, [0, 1, 2], torch.device("cpu"), route_shape=(2, 2))
    plain = collate(moved, [0, 1, 2], torch.device("cpu"), route_shape=(2, 2))
    # The shared prompt's positions, then each response's: the plain rows' routes at the same tokens
    prompt_len = grouped.prompt_ids.shape[1]
    assert grouped.routes.shape[1] == prompt_len + grouped.input_ids.numel()
    real = plain.attention_mask.reshape(-1).bool()
    assert torch.equal(plain.routes[:, real].unique(), grouped.routes[:, grouped.routes[0, :, 0] >= 0].unique())


def test_routes_of_another_shape_or_range_or_missing_under_replay_are_refused():
    model = tiny_model(seed=7)
    good = samples_with_routes(model)
    assert check_routes(good, 2, 2, 4, replay=True)
    short = [dataclasses.replace(good[0], routed_experts=good[0].routed_experts[:-1])] + good[1:]
    with pytest.raises(MoerlError, match="recorded for another model"):
        check_routes(short, 2, 2, 4, replay=False)
    wide = [dataclasses.replace(good[0], routed_experts=good[0].routed_experts + 4)] + good[1:]
    with pytest.raises(MoerlError, match=r"expert ids in \[-1, 4\)"):
        check_routes(wide, 2, 2, 4, replay=False)
    missing = [dataclasses.replace(good[0], routed_experts=None)] + good[1:]
    assert not check_routes(missing, 2, 2, 4, replay=False)
    with pytest.raises(MoerlError, match="records no routed experts, which trainer.routing_replay: rollout"):
        check_routes(missing, 2, 2, 4, replay=True)


def test_the_routes_column_reads_back_per_row():
    column = pa.chunked_array([
        pa.array([np.array([1, 2, 3], dtype=np.int16), None], type=pa.list_(pa.int16())),
        pa.array([[4, -1]], type=pa.list_(pa.int16())),
    ])  # fmt: skip
    rows = _int16_lists(column)
    assert rows[0].tolist() == [1, 2, 3] and rows[1] is None and rows[2].tolist() == [4, -1]


def replay_on_ranks(rank: int, world: int, out_dir: Path) -> None:
    """Two steps with routing replay on EP=2 (the all-to-all dispatch): each rank's weights and the metrics."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    full = tiny_model(seed=7)
    moved = samples_with_routes(full, perturb_layer=1)
    placement = ExpertPlacement.contiguous(len(full.moe_blocks()), full.config.num_experts, 2)
    model = sharded(full, placement, mesh.ep_rank).train()
    model.router_aux_loss_coef = 0.0
    model.set_dispatch(make_dispatch("alltoall", mesh, full.config.num_experts))
    settings = TrainSettings(micro_batch_size=3, steps_per_epoch=2, lr=1e-2, loss=LossSettings(kl_coef=0.0),
                             routing_replay="rollout")  # fmt: skip
    metrics = PolicyTrainer(model, mesh, settings, torch.optim.SGD(model.parameters(), lr=0.5)).train(moved, 1)
    out = {f"weight.{n}": p.detach().clone() for n, p in model.named_parameters()}
    out["disagreement"] = torch.tensor(per_layer(metrics["routing"], "router_disagreement"))
    out["used"] = torch.tensor(per_layer(metrics["routing"], "disagreement"))
    save_file(out, str(out_dir / f"rank{rank}.safetensors"))


def test_replay_through_the_expert_parallel_dispatch_gives_the_single_process_update(tmp_path):
    run_gloo(replay_on_ranks, 2, tmp_path, timeout=300)
    full = tiny_model(seed=7).train()
    full.router_aux_loss_coef = 0.0
    moved = samples_with_routes(full, perturb_layer=1)
    settings = TrainSettings(micro_batch_size=3, steps_per_epoch=2, lr=1e-2, loss=LossSettings(kl_coef=0.0),
                             routing_replay="rollout")  # fmt: skip
    # one process with the micro-batches of both ranks: micro_batch_size 3 x 2 ranks
    single = dataclasses.replace(settings, micro_batch_size=6)
    PolicyTrainer(full, Mesh(), single, torch.optim.SGD(full.parameters(), lr=0.5)).train(moved, 1)
    expected = {n: p.detach() for n, p in full.named_parameters()}
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert got["disagreement"].tolist() == [0.0, 1.0] and got["used"].tolist() == [0.0, 0.0]
        for key, value in got.items():
            if key.startswith("weight."):
                torch.testing.assert_close(value, expected[key[len("weight.") :]], atol=2e-6, rtol=1e-5, msg=key)


def test_the_trackers_get_every_layers_figures():
    from steps.tracking.trackers import metric_points

    model = tiny_model(seed=7)
    metrics, *_ = train(samples_with_routes(model, perturb_layer=1), "none")
    points = metric_points("update", {"routing": metrics["routing"]})
    assert points["update/routing/layers/1/router_disagreement"] == 1.0
    assert points["update/routing/layers/0/router_disagreement"] == 0.0
    assert points["update/routing/router_disagreement"] == 0.5 and points["update/routing/tokens"] > 0


def test_a_one_layer_model_records_its_prompts_last_token_only_in_that_layer():
    model = tiny_model(num_hidden_layers=1)
    requests, generations = generate(model, record=True)
    for request, g in zip(requests, generations, strict=True):
        n = len(request.prompt_ids)
        assert g.routed_experts.shape == (n + len(g.response_ids) - 1, 1, model.config.num_experts_per_tok)
        assert (g.routed_experts[: n - 1] == -1).all() and (g.routed_experts[n - 1 :] >= 0).all()
