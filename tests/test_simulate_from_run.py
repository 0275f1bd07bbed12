"""`moerl simulate --from-run RUN_STORE`: the mean response and prompt lengths and the tied share of a run's last
scored iterations (steps/score.py writes them) take the place of the assumptions of those names, said with their
source; an --assume still wins; a store without score metrics is one clear error."""

from __future__ import annotations

import json

import pytest
from test_simulate import EKS, run_cli

from pipelines.config import load_config
from pipelines.simulate.from_run import LAST_ITERATIONS, measured_assumptions
from steps.errors import MoerlError


def write_run(root, lengths: list[float], prompts: float = 200.0, tied: float = 0.4) -> str:
    metrics = root / "run" / "metrics"
    metrics.mkdir(parents=True)
    for i, length in enumerate(lengths, start=1):
        (metrics / f"iter-{i:06d}.json").write_text(json.dumps(
            {"iteration": i, "response_length_mean": length, "prompt_length_mean": prompts + i,
             "tied_group_fraction": tied}))  # fmt: skip
        (metrics / f"iter-{i:06d}.update.json").write_text(json.dumps({"update": {"loss": 1.0}}))
    return (root / "run").as_uri()


def test_the_last_iterations_lengths_and_tied_share_become_the_assumptions(tmp_path):
    cfg = load_config(EKS)
    run = write_run(tmp_path, [4000.0, 100.0, 1000.0, 2000.0, 3000.0])
    values, line = measured_assumptions(run, cfg)
    assert LAST_ITERATIONS == 3
    assert values["response_fill"] == pytest.approx(2000.0 / cfg.sampling.max_new_tokens)
    assert values["prompt_tokens"] == pytest.approx(204.0) and values["tied_group_share"] == pytest.approx(0.4)
    assert "responses 2,000 tokens on average" in line and "iterations 3-5" in line and run in line


def test_the_command_simulates_the_runs_lengths(tmp_path, capsys):
    run = write_run(tmp_path, [1024.0])
    run_cli([str(EKS), "--iterations", "4", "--assume", "response_fill=1"])  # over the config's stated 0.72
    at_the_cap = capsys.readouterr().out
    run_cli([str(EKS), "--iterations", "4", "--from-run", run])
    measured = capsys.readouterr().out
    assert "from the run: responses 1,024 tokens on average (fill 0.25 of 4,096)" in measured
    def mean(out: str) -> float:
        return float(out.split("iteration time, mean")[1].split()[0])
    assert mean(measured) < mean(at_the_cap)  # a quarter of the tokens to generate and train
    run_cli([str(EKS), "--iterations", "4", "--from-run", run, "--assume", "response_fill=1"])
    assert mean(capsys.readouterr().out) == mean(at_the_cap)  # an --assume wins


def test_a_run_without_score_metrics_is_one_clear_error(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(MoerlError, match=r"--from-run .*: no score metrics with response_length_mean under"):
        measured_assumptions((tmp_path / "run").as_uri(), load_config(EKS))


def test_explain_prints_every_assumption_with_its_source(tmp_path, capsys):
    import dataclasses

    from pipelines.simulate.sizing import Assumptions
    from pipelines.simulate.sources import CPU_SOURCES, GPU_SOURCES

    assert set(GPU_SOURCES) == set(CPU_SOURCES) == {f.name for f in dataclasses.fields(Assumptions)}
    run = write_run(tmp_path, [2048.0])
    run_cli([str(EKS), "--iterations", "2", "--explain", "--from-run", run, "--assume", "s3_gb_per_s=2"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 2}
    for field in dataclasses.fields(Assumptions):
        assert field.name in rows, field.name
    assert rows["s3_gb_per_s"].split()[1:3] == ["2", "--assume"]
    assert "measured: responses 2,048 tokens" in rows["response_fill"]
    assert "assumption: SGLang decode" in rows["rollout_tokens_per_gpu_s"]  # said to be one, with its nearest figure
    assert "LMSYS-EP" in rows["rollout_tokens_per_gpu_s"]
