"""The simulator against a real local run of the demo config: configs/demo.yaml rendered by the workflow
builders with tiny settings, run by the local executor with its real steps (rollout, score, update over
torchrun, publish); step times fitted from the run's status and simulated on this machine (one node that
runs every ready step at once, as the executor does) give the measured mean iteration time within 20%.

It skips, naming them, only while step modules that the workflow runs are not written yet."""

from __future__ import annotations

import importlib.util
import re
import statistics
import sys
from pathlib import Path

import pytest

from pipelines.config import load_config
from pipelines.local import run_workflow
from pipelines.sft_demo import sft_demo
from pipelines.simulate.measured import iteration_times_from_status, step_times_from_status
from pipelines.simulate.model import simulate
from pipelines.simulate.sizing import CPU_ASSUMPTIONS, local_cluster, measured_step_model
from pipelines.workflow import workflow
from steps.demo.sft import SftSettings

REPO = Path(__file__).resolve().parents[1]
FAST_RETRY = {"limit": 1, "backoff": {"duration": "1s", "factor": 1, "max_duration": "1m"}}


def step_modules(manifest: dict) -> list[str]:
    """Every `steps.X` module that the workflow's containers run (python -m / torchrun -m)."""
    found = set()
    for template in manifest["spec"]["templates"]:
        container = template.get("container") or {}
        for word in [*container.get("command", []), *container.get("args", [])]:
            if re.fullmatch(r"steps\.\w+", str(word)):
                found.add(word)
    return sorted(found)


# shape -> its settings, and the first iteration compared. With servers, the first iteration waits for their
# start-up after v000000, which no step of the status times (the model derives it); the iterations after it
# are served throughout, and are what the servers' model is checked on.
SHAPES = {
    "engines-per-step": ({"iterations": 1}, 0),
    "servers": (
        {
            "iterations": 3,
            "rollout.servers": 2,
            "trainer.server": True,
            "prompts_per_iteration": 1024,
            "group_size": 8,
            "rollout.chunk_size": 128,
            "trainer.micro_batch_size": 64,
            "trainer.steps_per_epoch": 128,
        },
        1,
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_simulated_iteration_time_matches_a_real_demo_run(tmp_path, monkeypatch, shape):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        {
            "sft_checkpoint": (tmp_path / "sft").as_uri(),
            "run_store": (tmp_path / "run").as_uri(),
            "prompts_per_iteration": 16,
            "group_size": 4,
            "rollout.chunk_size": 8,
            "heldout_size": 8,
            "trainer.micro_batch_size": 16,
            "trainer.steps_per_epoch": 1,
            "retries": {role: FAST_RETRY for role in ("rollout", "score", "trainer", "control")},
            **SHAPES[shape][0],
        },
    )
    manifest = workflow(cfg).to_dict()
    modules = step_modules(manifest)
    assert {"steps.rollout", "steps.score", "steps.update", "steps.publish"} <= set(modules)
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the workflow's steps {', '.join(missing)} are not written yet; this validation needs them")

    sft_demo((tmp_path / "sft").as_uri(), SftSettings(steps=2, train_prompts=64, eval_prompts=8, batch_size=16))
    status = tmp_path / "status.json"
    result = run_workflow(manifest, view=None, workdir=tmp_path / "work", status_out=status)
    assert result.succeeded, f"{result.message}; logs under {result.run_dir}/pods"

    measured = iteration_times_from_status(status)
    assert len(measured) == cfg.iterations
    steps = measured_step_model(cfg, CPU_ASSUMPTIONS, step_times_from_status(status), "status.json")
    simulated = simulate(cfg, steps, local_cluster(cfg), CPU_ASSUMPTIONS)
    first = SHAPES[shape][1]
    mean_measured = statistics.mean(measured[first:])
    mean_simulated = statistics.mean(simulated.iteration_times[first:])
    error = abs(mean_simulated - mean_measured) / mean_measured
    print(f"{shape}: measured {measured}, simulated {simulated.iteration_times}, error {error:.1%}", file=sys.stderr)
    print(f"{shape}: step times {step_times_from_status(status)}", file=sys.stderr)
    assert error <= 0.20, (simulated.iteration_times, measured, step_times_from_status(status))
