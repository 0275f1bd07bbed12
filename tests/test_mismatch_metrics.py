"""The train-inference mismatch each update reports (steps/training/mismatch.py): k3 KL(behaviour || trainer)
and the importance ratio's extremes and percentiles, by hand; summed over ranks as one set of tokens; measured
on the weights the samples were drawn for in every update mode (one step, recomputed old log-probs, the engine's
as old log-probs); shown by the report."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from experience_helpers import tiny_model
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo
from test_trainer_old_logprobs import on_policy_samples

from steps.expert_parallel.mesh import Mesh, build_mesh
from steps.report import COLUMNS, find_field, flatten
from steps.training.mismatch import BINS, LOG_RANGE, MismatchStats
from steps.training.trainer import PolicyTrainer, TrainSettings

HALF_BIN = LOG_RANGE / BINS  # in log-ratio: the percentiles' resolution


def test_the_figures_by_hand():
    log_r = torch.tensor([0.0, 0.1, -0.2, 0.5, -1.0, 0.0, 0.0, 0.3, 2.0, -0.05])
    stats = MismatchStats()
    stats.add(log_r, torch.zeros_like(log_r), torch.ones_like(log_r))
    stats.add(torch.tensor([9.0]), torch.zeros(1), torch.zeros(1))  # masked out: not counted
    stats.add(torch.tensor([float("nan"), -float("inf")]), torch.zeros(2), torch.ones(2))  # counted apart
    got = stats.reduce(Mesh())
    assert got["tokens"] == 10 and got["nonfinite_tokens"] == 2
    assert got["k3"] == pytest.approx(float((log_r.exp() - 1 - log_r).mean()))
    assert got["ratio"]["max"] == pytest.approx(math.exp(2.0)) and got["ratio"]["min"] == pytest.approx(math.exp(-1))
    ordered = sorted(log_r.tolist())
    assert math.log(got["ratio"]["p50"]) == pytest.approx(ordered[4], abs=HALF_BIN * 1.01)
    assert math.log(got["ratio"]["p01"]) == pytest.approx(ordered[0], abs=HALF_BIN * 1.01)
    assert math.log(got["ratio"]["p99"]) == pytest.approx(ordered[-1], abs=HALF_BIN * 1.01)
    assert MismatchStats().reduce(Mesh()) is None  # no tokens: nothing measured


def two_ranks(rank: int, world: int, out_dir: Path) -> None:
    mesh = build_mesh(rank, world, 1, torch.device("cpu"))
    stats = MismatchStats()
    log_r = torch.tensor([0.2, -0.4, 1.0]) if rank == 0 else torch.tensor([0.0, 3.0])
    stats.add(log_r, torch.zeros_like(log_r), torch.ones_like(log_r))
    got = stats.reduce(mesh)
    save_file({"k3": torch.tensor(got["k3"]), "max": torch.tensor(got["ratio"]["max"]),
               "tokens": torch.tensor(float(got["tokens"]))}, str(out_dir / f"rank{rank}.safetensors"))  # fmt: skip


def test_the_ranks_tokens_count_as_one_set(tmp_path):
    run_gloo(two_ranks, 2, tmp_path)
    every = torch.tensor([0.2, -0.4, 1.0, 0.0, 3.0])
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert float(got["tokens"]) == 5 and float(got["max"]) == pytest.approx(math.exp(3.0))
        assert float(got["k3"]) == pytest.approx(float((every.exp() - 1 - every).mean()))


@pytest.mark.parametrize(("steps", "old_logprobs"), [(1, "recompute"), (3, "recompute"), (3, "behavior")])
def test_every_update_mode_measures_the_weights_the_samples_came_from(steps, old_logprobs):
    model = tiny_model().train()
    samples = on_policy_samples(model)  # behaviour log-probs: the model's own (the torch engine at staleness 0)
    shift = 0.1  # the engine's log-probs 0.1 below the trainer's on every token: log r = 0.1 exactly
    shifted = [dataclasses.replace(s, behavior_logprobs=[x - shift for x in s.behavior_logprobs]) for s in samples]
    settings = TrainSettings(micro_batch_size=4, steps_per_epoch=steps, lr=1e-2, old_logprobs=old_logprobs)
    metrics = PolicyTrainer(model, Mesh(), settings).train(shifted, iteration=1)
    got = metrics["mismatch"]
    every = sum(len(s.response_ids) for s in samples)
    if old_logprobs == "behavior" and steps > 1:  # no pass before the update but the first step's forward
        assert 0 < got["tokens"] < every
    else:
        assert got["tokens"] == every
    assert got["k3"] == pytest.approx(math.exp(shift) - 1 - shift, rel=1e-3)
    for name in ("max", "min", "p01", "p50", "p99"):
        assert math.log(got["ratio"][name]) == pytest.approx(shift, abs=HALF_BIN + 1e-4), name


def test_the_report_shows_them():
    flat = flatten({"update": {"mismatch": {"k3": 0.01, "ratio": {"p99": 1.2}}}})
    assert find_field(flat, COLUMNS["mismatch_k3"]) == 0.01
    assert find_field(flat, COLUMNS["mismatch_ratio_p99"]) == 1.2


@pytest.mark.parametrize("steps", [1, 2])
def test_the_update_step_reports_every_ranks_tokens(tmp_path, steps):
    """Two ranks (EP=2), one step or two (old log-probs recomputed, each rank over its own samples): the mismatch
    counts every trained response token once; the torch engine's behaviour log-probs here are synthetic, so the
    ratio is far from 1 and k3 well above 0."""
    from test_update_experience import experience_table, make_run, start_ranks, wait_ranks, write_experience

    from steps.run.keys import update_metrics_key
    from steps.store.object_store import Store

    run_uri = make_run(tmp_path, trainer={"steps_per_epoch": steps})
    table = experience_table(policy_version=0, prompts=4, group=4)
    write_experience(run_uri, 1, table)
    results = wait_ranks(start_ranks(run_uri, 1, 2))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
    got = Store.open(run_uri).get_json(update_metrics_key(1))["update"]["mismatch"]
    trained = [len(r) for r, a in zip(table.column("response_ids").to_pylist(), table.column("advantage").to_pylist(),
                                      strict=True) if a != 0]  # fmt: skip
    assert got["tokens"] == sum(trained) and got["k3"] > 0
    ratio = got["ratio"]
    assert ratio["min"] <= ratio["p01"] <= ratio["p50"] <= ratio["p99"] <= ratio["max"]


def test_the_report_reads_them_from_the_iterations_update_metrics(tmp_path):
    from steps.report import collect
    from steps.run.keys import metrics_key, update_metrics_key
    from steps.store.object_store import Store

    run = Store.open(tmp_path.as_uri())
    run.put_json(metrics_key(1), {"score": {"reward_mean": 0.5}})
    run.put_json(update_metrics_key(1), {"update": {"mismatch": {"k3": 0.02, "ratio": {"p99": 1.5}}, "kl": 0.1}})
    run.put_json(metrics_key(2), {"score": {"reward_mean": 0.6}})  # its update has not written yet
    rows = collect(run).rows
    assert (rows[0]["mismatch_k3"], rows[0]["mismatch_ratio_p99"], rows[0]["kl"]) == (0.02, 1.5, 0.1)
    assert rows[1]["mismatch_k3"] is None and rows[1]["reward"] == 0.6
