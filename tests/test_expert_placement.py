"""Router-aware expert placement: which E/ep experts each EP rank holds, per MoE layer.

balanced_placement's partition (optimal where the optimum is provable, contiguous where contiguous is already
best, never worse than contiguous); EP=2 with a non-identity placement against EP=1 (loss, gradients,
weights after SGD); and the update workflow: iteration 1 records per-expert row counts, iteration 2 takes a
balanced placement from them, so experts and their optimizer state cross shard files, and the result equals
the contiguous update's, restarts bit-identically, publishes, and loads in the engine.
"""

from __future__ import annotations

import itertools
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file
from test_expert_parallel import run_gloo
from test_expert_parallel_training import train_once
from test_update_experience import (
    experience_table,
    make_run,
    start_ranks,
    tiny_model,
    wait_ranks,
    write_experience,
)

from steps.engines.interface import GenerationRequest, SamplingParams
from steps.engines.torch_engine import TorchEngine
from steps.models.hf_checkpoint import expected_tensor_shapes, load_pretrained
from steps.models.placement import ExpertPlacement, balanced_placement, is_expert_param
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.publish import publish
from steps.run import checkpoint
from steps.run.candidate import CANDIDATE_INDEX, MARKER, model_shard_name, optimizer_shard_name
from steps.run.keys import candidate_prefix, update_metrics_key
from steps.store.object_store import Store
from steps.update import choose_placement

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEMO_STOP = (2,)  # the demo tokenizer's <eos>: these checkpoints stop there (steps.demo.char_tokenizer.EOS_ID)


def max_group(loads: list[int], placement: ExpertPlacement, layer: int = 0) -> int:
    return max(sum(loads[e] for e in placement.held(layer, r)) for r in range(placement.ep_size))


def optimum(loads: list[int], ep_size: int) -> int:
    """Brute force: the smallest possible largest group over all splits into equal groups (small E only)."""
    per_rank = len(loads) // ep_size

    def best(remaining: tuple[int, ...]) -> int:
        if not remaining:
            return 0
        first, rest = remaining[0], remaining[1:]
        return min(
            max(loads[first] + sum(loads[e] for e in others), best(tuple(e for e in rest if e not in others)))
            for others in itertools.combinations(rest, per_rank - 1)
        )

    return best(tuple(range(len(loads))))


# ---------------------------------------------------------------------------------- balanced_placement


def test_balanced_placement_reaches_the_optimum_where_it_is_provable():
    # total 36 over 2 ranks: no split can beat 18, and {8, 7, 2, 1} | {6, 5, 4, 3} reaches it
    loads = [8, 7, 6, 5, 4, 3, 2, 1]
    placement = balanced_placement([loads], 2)
    assert max_group(loads, placement) == 18
    assert max_group(loads, ExpertPlacement.contiguous(1, 8, 2)) == 26
    # one expert dominates: the best is that expert with the E/ep - 1 lightest others
    loads = [3, 100, 2, 9, 1, 7, 5, 4]
    placement = balanced_placement([loads], 2)
    assert max_group(loads, placement) == 100 + 1 + 2 + 3
    assert set(placement.held(0, 0) + placement.held(0, 1)) == set(range(8))
    # four ranks of two experts: 8+1, 7+2, 6+3, 5+4 are all 9 = 36 / 4
    placement = balanced_placement([[8, 7, 6, 5, 4, 3, 2, 1]], 4)
    assert max_group([8, 7, 6, 5, 4, 3, 2, 1], placement) == 9


def test_contiguous_is_kept_when_it_is_already_best():
    placement = balanced_placement([[5, 1, 1, 5], [0, 0, 0, 0]], 2)
    assert placement.is_contiguous()
    assert balanced_placement([[3, 9, 4, 1, 7, 2]], 1).is_contiguous()  # one rank holds everything


def test_balanced_placement_is_per_layer_deterministic_and_never_worse_than_contiguous():
    rng = random.Random(3)
    tables = [[[rng.randrange(0, 1000) for _ in range(8)] for _ in range(3)] for _ in range(20)]
    contiguous = ExpertPlacement.contiguous(3, 8, 2)
    for loads in tables:
        placement = balanced_placement(loads, 2)
        assert placement == balanced_placement(torch.tensor(loads), 2)  # list or tensor, same answer
        for layer, layer_loads in enumerate(loads):
            assert sorted(placement.slots[layer]) == list(range(8))
            assert [len(placement.held(layer, r)) for r in range(2)] == [4, 4]
            got = max_group(layer_loads, placement, layer)
            assert optimum(layer_loads, 2) <= got <= max_group(layer_loads, contiguous, layer)
            # greedy + swaps is close to the optimum: within the lightest expert's load here
            assert got - optimum(layer_loads, 2) <= max(layer_loads)
    # the layers are independent: a different table per layer gives different slots
    placement = balanced_placement([[9, 9, 1, 1], [9, 1, 9, 1]], 2)
    assert placement.held(0, 0) == (0, 2) and placement.slots[1] == (0, 1, 2, 3)


def test_bad_loads_and_placements_are_refused():
    with pytest.raises(ValueError, match="does not divide"):
        balanced_placement([[1, 2, 3]], 2)
    with pytest.raises(ValueError, match="non-negative integers"):
        balanced_placement([[1, -2, 3, 4]], 2)
    with pytest.raises(ValueError, match="table"):
        balanced_placement([[1, 2], [1, 2, 3, 4]], 2)
    with pytest.raises(ValueError, match="not a permutation"):
        ExpertPlacement.from_lists([[0, 0, 1, 2]], 2)
    cfg = MoeConfig(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4)  # fmt: skip
    with pytest.raises(ValueError, match="MoE layers"):
        MoeForCausalLM(cfg, ExpertPlacement.contiguous(1, 4, 2))


def test_a_rank_holds_its_placed_experts_under_their_global_names():
    cfg = MoeConfig(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4)  # fmt: skip
    placement = ExpertPlacement.from_lists([[3, 0, 2, 1], [1, 2, 0, 3]], 2)
    model = MoeForCausalLM(cfg, placement, ep_rank=1)
    assert set(model.state_dict()) == set(expected_tensor_shapes(cfg, placement, ep_rank=1))
    assert {n.split(".")[2] + ":" + n.split(".")[5] for n in model.state_dict() if is_expert_param(n)} == {
        "0:1", "0:2", "1:0", "1:3"
    }  # fmt: skip
    # the block routes by slot: expert 2 of layer 0 is slot 2, held first by EP rank 1
    block = model.moe_blocks()[0]
    assert block.to_slots(torch.tensor([[3, 0], [2, 1]])).tolist() == [[0, 1], [2, 3]]
    assert block.held == (2, 1)


# ---------------------------------------------------------------------- EP=2 (placed) == EP=1, one step


def test_ep2_with_a_non_identity_placement_equals_ep1(tmp_path):
    """Rank 0 holds experts {3, 0} of layer 0 and {1, 2} of layer 1: every slot of the all-to-all goes
    through the placement's mapping, and the result is still EP=1's."""
    slots = [[3, 0, 2, 1], [1, 2, 0, 3]]
    (tmp_path / "ep1").mkdir()
    (tmp_path / "ep2").mkdir()
    train_once(0, 1, tmp_path / "ep1", 1, "token-mean")
    run_gloo(train_once, 2, tmp_path / "ep2", 2, "token-mean", slots)
    ref = load_file(tmp_path / "ep1" / "rank0.safetensors")
    ranks = [load_file(tmp_path / "ep2" / f"rank{r}.safetensors") for r in range(2)]
    checked = set()
    for got in ranks:
        torch.testing.assert_close(got["stats"][0], ref["stats"][0], atol=1e-5, rtol=0)  # the loss
        for key, value in got.items():
            if key != "stats":
                torch.testing.assert_close(value, ref[key], atol=1e-5, rtol=0, msg=key)
                checked.add(key)
    assert checked == set(ref) - {"stats"}, "every parameter's gradient and weight is held by some rank"
    rank1 = {k.split(".")[3] + ":" + k.split(".")[6] for k in ranks[1] if k.startswith("grad.") and is_expert_param(k)}
    assert rank1 == {"0:2", "0:1", "1:0", "1:3"}
    initial = tiny_model(0).state_dict()
    assert any(not torch.equal(ref[k], initial[k[7:]]) for k in ref if k.startswith("weight.") and is_expert_param(k))


# ------------------------------------------------------------------------------------ the update workflow

# Two optimizer steps per iteration (so AdamW state matters), KL to v000000 (so the reference model is
# placed too).
TRAINER = {"micro_batch_size": 4, "epochs": 1, "steps_per_epoch": 2, "lr": 5e-3, "kl_coef": 0.05}
# Forced loads for iteration 2's placement: layer 0 puts experts 0 and 1 on one rank when contiguous.
CRAFTED_ROWS = [[100, 90, 1, 2], [5, 80, 3, 70]]


def update(run_uri: str, iteration: int, *extra: str) -> str:
    results = wait_ranks(start_ranks(run_uri, iteration, 2, *extra))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    return results[0][1]


def candidate_weights(run: Store, iteration: int, tmp_path) -> tuple[dict, dict, dict]:
    """(weights, optimizer state, weight_map) of the candidate, read from its shards."""
    prefix = candidate_prefix(iteration)
    index = run.get_json(f"{prefix}/{CANDIDATE_INDEX}")
    weights, state = {}, {}
    for name in sorted(set(index["weight_map"].values()) | set(index["optimizer_map"].values())):
        run.get_file(f"{prefix}/{name}", tmp_path / name)
        (weights if name.startswith("model") else state).update(load_file(tmp_path / name))
    return weights, state, index["weight_map"]


def set_placement_mode(run: Store, mode: str) -> None:
    config = run.get_json("run.json")
    config["trainer"]["expert_placement"] = mode
    run.put_json("run.json", config)


def test_update_balances_from_the_previous_counts_and_matches_contiguous(tmp_path):
    run_uri = make_run(tmp_path, trainer=TRAINER)
    run = Store.open(run_uri)
    write_experience(run_uri, 1, experience_table(policy_version=0, prompts=4, group=4))
    out = update(run_uri, 1)
    assert "expert placement: contiguous (iteration 1" in out

    # Iteration 1's metrics: the rows each expert got (all ranks, every forward of the policy) and the
    # placement used (contiguous: there were no earlier counts).
    metrics = run.get_json(update_metrics_key(1))["update"]
    rows = metrics["expert_rows"]
    assert len(rows) == 2 and all(len(r) == 4 for r in rows)
    assert sum(rows[0]) > 0 and sum(rows[0]) == sum(rows[1]) and sum(rows[0]) % 2 == 0  # top-2, every token
    assert metrics["expert_placement"]["slots"] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert "iteration 1" in metrics["expert_placement"]["reason"]
    assert metrics["expert_rank_rows"] == [[r[0] + r[1], r[2] + r[3]] for r in rows]
    publish(run_uri, 1)

    # Iteration 2 balances from iteration 1's counts. Here they are replaced by loads that make the
    # balanced placement differ from the contiguous one in both layers (the tiny model's own counts may
    # happen to be balanced already).
    metrics_1 = run.get_json(update_metrics_key(1))
    metrics_1["update"]["expert_rows"] = CRAFTED_ROWS
    run.put_json(update_metrics_key(1), metrics_1)
    expected = balanced_placement(CRAFTED_ROWS, 2)
    assert expected.held(0, 0) == (0, 2) and expected.held(1, 0) == (0, 3)  # ... so experts move
    cfg = load_pretrained(checkpoint.fetch(run, 1)).config
    assert choose_placement(run, 2, "balanced", cfg, 2)[0] == expected

    write_experience(run_uri, 2, experience_table(policy_version=1, prompts=4, group=4, seed=5))

    # First the update with the contiguous placement (trainer.expert_placement: contiguous), for reference.
    set_placement_mode(run, "contiguous")
    out = update(run_uri, 2)
    assert "trainer.expert_placement: contiguous" in out
    contiguous, _, contiguous_map = candidate_weights(run, 2, tmp_path)
    assert contiguous_map["model.layers.0.mlp.experts.2.up_proj.weight"] == model_shard_name(1, 2)

    # The balanced update (the default) of the same iteration.
    set_placement_mode(run, "balanced")
    out = update(run_uri, 2, "--force")
    assert "expert placement: balanced" in out
    metrics_2 = run.get_json(update_metrics_key(2))["update"]
    assert metrics_2["expert_placement"]["slots"] == expected.to_lists()
    assert metrics_2["expert_rank_rows"] == expected.rank_rows(metrics_2["expert_rows"])
    balanced, balanced_state, weight_map = candidate_weights(run, 2, tmp_path)
    # Expert 2 of layer 0 was EP rank 1's in iteration 1 and is EP rank 0's now, with its optimizer state.
    assert weight_map["model.layers.0.mlp.experts.2.up_proj.weight"] == model_shard_name(0, 2)
    assert weight_map["model.layers.0.mlp.experts.1.up_proj.weight"] == model_shard_name(1, 2)
    assert optimizer_shard_name(0, 2) in run.get_json(f"{candidate_prefix(2)}/{MARKER}")["files"]
    steps = {float(t) for n, t in balanced_state.items() if n.endswith(".step")}
    assert steps == {4.0}, "every parameter resumed AdamW from v000001 (2 steps) and took 2 more"
    # ... and it equals the contiguous update, to float rounding
    initial = load_pretrained(checkpoint.fetch(run, 1)).state_dict()
    assert any(not torch.equal(balanced[n], initial[n]) for n in balanced if is_expert_param(n))
    assert contiguous.keys() == balanced.keys()
    for name, weight in contiguous.items():
        torch.testing.assert_close(balanced[name], weight, atol=1e-6, rtol=0, msg=name)

    # A restart of the same update chooses the same placement and gives the same bits.
    update(run_uri, 2, "--force")
    again, again_state, _ = candidate_weights(run, 2, tmp_path)
    assert again.keys() == balanced.keys() and all(torch.equal(again[n], balanced[n]) for n in balanced)
    assert all(torch.equal(again_state[n], balanced_state[n]) for n in balanced_state)

    # The balanced candidate publishes and loads, by name, in the rollout engine.
    publish(run_uri, 2)
    v2 = checkpoint.fetch(run, 2)
    index = json.loads((v2 / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.0.mlp.experts.2.up_proj.weight"] == "model-00001-of-00002.safetensors"
    engine = TorchEngine.from_checkpoint(v2)
    state = engine.model.state_dict()
    assert all(torch.equal(state[n], balanced[n]) for n in balanced)
    generated = engine.generate([GenerationRequest("p", (1, 5, 9, 7), 0, seed=3)], SamplingParams(max_new_tokens=4))
    assert len(generated[0].response_ids) >= 1


def test_placement_falls_back_to_contiguous_on_absent_or_malformed_counts(tmp_path):
    run_uri = make_run(tmp_path)
    run = Store.open(run_uri)
    cfg = load_pretrained(checkpoint.fetch(run, 0)).config
    contiguous = ExpertPlacement.contiguous(2, 4, 2)

    placement, reason = choose_placement(run, 3, "balanced", cfg, 2)
    assert placement == contiguous and "metrics/iter-000002.update.json is absent" in reason
    for bad in (
        {"iteration": 2, "update": {"expert_rows": [[1, 2, 3], [1, 2, 3]]}},  # wrong shape
        {"iteration": 2, "update": {"expert_rows": [[1, 2, 3, -4], [1, 2, 3, 4]]}},  # negative
        {"iteration": 2, "update": {"expert_rows": [[1, 2, 3, 0.5], [1, 2, 3, 4]]}},  # not a count
        {"iteration": 1, "update": {"expert_rows": CRAFTED_ROWS}},  # another iteration's
        {"iteration": 2, "update": {"loss": 1.0}},  # written before placement existed
        [1, 2, 3],
    ):
        run.put_json(update_metrics_key(2), bad)
        placement, reason = choose_placement(run, 3, "balanced", cfg, 2)
        assert placement == contiguous and reason.startswith("contiguous (metrics/iter-000002.update.json")
    run.put_bytes(update_metrics_key(2), b"{not json")
    placement, reason = choose_placement(run, 3, "balanced", cfg, 2)
    assert placement == contiguous and "not valid JSON" in reason

    run.put_json(update_metrics_key(2), {"iteration": 2, "update": {"expert_rows": CRAFTED_ROWS}})
    assert choose_placement(run, 3, "balanced", cfg, 2)[0] == balanced_placement(CRAFTED_ROWS, 2)
    placement, reason = choose_placement(run, 3, "contiguous", cfg, 2)
    assert placement == contiguous and "trainer.expert_placement: contiguous" in reason
    assert choose_placement(run, 3, "balanced", cfg, 1)[0] == ExpertPlacement.contiguous(2, 4, 1)
