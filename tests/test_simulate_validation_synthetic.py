"""The simulator against the local executor: the demo config's workflow, rendered by the real builders, with
every step replaced by a `sleep` of known length, run by `moerl local`; step times fitted from its status and
simulated on this machine's pools give the measured mean iteration time within 20%, sync and async.

Durations are whole seconds because the status stamps pods with whole seconds (as Kubernetes does): the
median of a whole-second sleep's stamped durations is that number of seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import load_config
from pipelines.local import run_workflow
from pipelines.simulate.measured import iteration_times_from_status, step_times_from_status
from pipelines.simulate.model import simulate, simulate_both
from pipelines.simulate.sizing import CPU_ASSUMPTIONS, local_cluster, measured_step_model
from pipelines.workflow import workflow

REPO = Path(__file__).resolve().parents[1]
# Seconds each step sleeps. rollout + score (3) > update + publish (2), so the async loop has two iterations in
# flight and is bound by half the loop, not by one side.
SLEEP = {"import-sft": 1, "rollout": 2, "score": 1, "update": 1, "publish": 1}


def sleeping_workflow(tmp_path: Path, staleness: int) -> tuple[dict, object]:
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        {"run_store": (tmp_path / "run").as_uri(), "iterations": 3, "staleness": staleness},
    )
    manifest = workflow(cfg).to_dict()
    for template in manifest["spec"]["templates"]:
        container = template.get("container")
        if container is None:
            continue
        name = template["name"]
        if name == "plan":  # a fresh run: no LATEST yet
            container["command"], container["args"] = (
                ["sh", "-c", "mkdir -p /tmp/plan && echo -1 > /tmp/plan/latest"],
                [],
            )
        elif name in SLEEP:
            container["command"], container["args"] = ["sleep", str(SLEEP[name])], []
        else:  # the report
            container["command"], container["args"] = ["true"], []
    return manifest, cfg


@pytest.mark.parametrize("staleness", [0, 1])
def test_simulated_iteration_time_matches_the_local_executor(tmp_path, staleness):
    manifest, cfg = sleeping_workflow(tmp_path, staleness)
    result = run_workflow(manifest, view=None, workdir=tmp_path / "work", status_out=tmp_path / "status.json")
    assert result.succeeded, result.message

    fitted = step_times_from_status(tmp_path / "status.json")
    for step, seconds in SLEEP.items():
        assert abs(fitted[step] - seconds) <= 1, (step, fitted)
    measured = iteration_times_from_status(tmp_path / "status.json")
    assert len(measured) == 3

    steps = measured_step_model(cfg, CPU_ASSUMPTIONS, fitted, "status.json")
    simulated = simulate(cfg, steps, local_cluster(cfg), CPU_ASSUMPTIONS, staleness=staleness)
    mean_measured = sum(measured) / len(measured)
    error = abs(simulated.mean_iteration_s - mean_measured) / mean_measured
    assert error <= 0.20, (simulated.iteration_times, measured)


def test_the_model_predicts_what_async_buys_on_this_workflow(tmp_path):
    """Before running anything: the known sleeps alone predict the sync and async iteration times."""
    _, cfg = sleeping_workflow(tmp_path, 0)
    steps = measured_step_model(cfg, CPU_ASSUMPTIONS, {**SLEEP, "plan": 0, "report": 0}, "sleeps")
    results = simulate_both(cfg, steps, local_cluster(cfg), CPU_ASSUMPTIONS)
    assert results[0].iteration_times == pytest.approx([5, 5, 5])
    # publish-2 waits for rollout-2 + score-2 (started with rollout-1): max(5, 3) + 2; publish-3 for rollout-3
    # (started at publish-1): 5 + 3 + 2 = 10 after the start.
    assert results[1].iteration_times == pytest.approx([5, 2, 3])
