"""The demo workflow's invariants: chaos (Spot preemptions and a hard kill) and the number of rollout shards
change nothing in the final weights, with routing replay (the engine's recorded experts travel through chunks,
retries and the score into the update) and dynamic sampling (each iteration's prompt count read from the score
metrics of the one before) on; `moerl demo` runs end to end and prints its report."""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipelines.config import load_config
from pipelines.demo import DEMO_CONFIG, run_config
from pipelines.sft_demo import sft_demo
from steps.demo.sft import SftSettings

REPO = Path(__file__).resolve().parents[1]
TINY = {"iterations": 2, "prompts_per_iteration": 16, "group_size": 4, "heldout_size": 16, "rollout.chunk_size": 4,
        "trainer.routing_replay": "rollout", "rollout.dynamic_sampling": True,
        "rollout.dynamic_sampling_max_factor": 2.0}


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "sft-demo"
    sft_demo(str(out), SftSettings(steps=40, eval_prompts=16))
    return out


def final_weights(sft_dir: Path, workdir: Path, chaos: str | None = None, shards: int = 2) -> dict[str, str]:
    return run_demo(sft_dir, workdir, chaos, shards)[0]


def run_demo(sft_dir: Path, workdir: Path, chaos: str | None = None, shards: int = 2) -> tuple[dict[str, str], Any]:
    overrides = {**TINY, "sft_checkpoint": str(sft_dir), "run_store": str(workdir / "run")}
    overrides["rollout.num_shards"] = shards
    result = run_config(load_config(DEMO_CONFIG, overrides), workdir, chaos)
    assert result.succeeded, (result.phase, result.message)
    final = workdir / "run" / "checkpoints" / "v000002"
    assert (final / "MANIFEST.json").is_file()
    weights = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(final.glob("*.safetensors"))}
    return weights, result


CHAOS = "preempt=3,kill=1,seed=28"  # lands on two rollout shards and a score (preemptions) and an update (kill)


@pytest.mark.faults
def test_chaos_and_shard_count_leave_the_final_weights_bit_identical(sft_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")  # retry backoffs and grace periods, not the steps
    baseline = final_weights(sft_dir, tmp_path / "plain")
    assert baseline
    update = json.loads((tmp_path / "plain" / "run" / "metrics" / "iter-000002.update.json").read_text())["update"]
    assert update["routing"]["replay"] and update["routing"]["disagreement"] == 0.0  # the engine's experts, used
    assert min(layer["tokens"] for layer in update["routing"]["layers"].values()) > 0
    for iteration in (1, 2):  # 32 prompts generated first, then what iteration 1's tied share asks for
        score = json.loads((tmp_path / "plain" / "run" / "metrics" / f"iter-00000{iteration}.json").read_text())
        kept = score["dynamic_sampling"]
        assert kept["trained_mixed_groups"] + kept["trained_tied_groups"] == 16 and kept["trained_samples"] == 64
        assert 16 <= kept["generated_groups"] <= 32 and (iteration == 2 or kept["generated_groups"] == 32)
    weights, chaos_run = run_demo(sft_dir, tmp_path / "chaos", chaos=CHAOS)
    assert weights == baseline
    assert final_weights(sft_dir, tmp_path / "one-shard", shards=1) == baseline
    assert final_weights(sft_dir, tmp_path / "three-shards", shards=3) == baseline

    # Every fault the spec names landed, each on an attempt that the workflow's retryStrategy then retried
    # (run_workflow raises if any had not landed; this checks what the status recorded of each).
    landed = [(f.kind, f.template) for f in chaos_run.faults]
    print("chaos landed:", landed)
    assert sorted(kind for kind, _ in landed) == ["kill", "preempt", "preempt", "preempt"]
    assert all(template in ("rollout", "score") for kind, template in landed if kind == "preempt")  # Spot pools
    nodes = json.loads((tmp_path / "chaos" / "status.json").read_text())["nodes"]
    by_name = {n["name"]: n for n in nodes.values()}
    for fault in chaos_run.faults:
        attempt = by_name[fault.node_name]
        assert (attempt["phase"], attempt["message"]) == (fault.phase, fault.message)
        retry = next(n for n in nodes.values() if n["type"] == "Retry" and attempt["id"] in n.get("children", []))
        later = [nodes[c] for c in retry["children"][retry["children"].index(attempt["id"]) + 1 :]]
        assert later and later[-1]["phase"] == "Succeeded", fault


def test_moerl_demo_runs_end_to_end_and_reports(sft_dir, tmp_path):
    workdir = tmp_path / "demo"
    workdir.mkdir()
    (workdir / "sft-demo").symlink_to(sft_dir)
    result = subprocess.run(
        [sys.executable, "-c", "from pipelines.cli import main; main()", "demo", "--workdir", str(workdir),
         "--iterations", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Succeeded" in result.stdout
    assert "LATEST = v000001" in result.stdout
    assert (workdir / "run" / "report" / "report.png").read_bytes()[:4] == b"\x89PNG"
    metrics_files = sorted((workdir / "run" / "metrics").glob("*.json"))
    assert metrics_files
    for path in metrics_files:  # strict JSON: no Infinity or NaN
        json.loads(path.read_text(), parse_constant=lambda token, name=path.name: pytest.fail(f"{name}: {token}"))


def heldout_gain(args: list[str], tmp_path: Path) -> tuple[float, float]:
    """`moerl demo ARGS --workdir tmp_path` as a user runs it (the SFT checkpoint built there too): the held-out
    accuracy of v000000 and of v000008, in percent, as the run's report states them."""
    result = subprocess.run(
        [sys.executable, "-c", "from pipelines.cli import main; main()", "demo", *args, "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    print(report)  # pytest shows it beside a failed bar
    outcome = re.search(r"held-out accuracy ([\d.]+)% \(v000000.*\) -> ([\d.]+)% \(v000008\)", report)
    assert outcome, report
    return float(outcome[1]), float(outcome[2])


def test_the_default_demo_raises_heldout_accuracy_by_15_points(tmp_path):
    # `moerl demo` as `make demo` runs it: configs/demo.yaml unchanged.
    start, end = heldout_gain([], tmp_path)
    assert 20 <= start <= 60, (start, end)  # the SFT checkpoint leaves room for RL
    # On this kind of machine the run is bit-reproducible and gives +26.8 points (README), seeds 1-4 +21.5 to
    # +24.4 (bench/README.md, "demo seeds"). Another CPU's float rounding changes the sampled trajectory: the bar
    # below catches a recipe that stopped learning without failing on that spread.
    assert end - start >= 12, (start, end)


def test_the_chat_demo_raises_heldout_accuracy_by_15_points(tmp_path):
    # `moerl demo --config configs/demo-chat.yaml`: a BPE tokenizer trained on the task's text, a ChatML template,
    # natural-language prompts and the math verifier; measured +33.0 points (52.7% -> 85.7%) in 396 s (bench/README.md)
    start, end = heldout_gain(["--config", str(REPO / "configs" / "demo-chat.yaml")], tmp_path)
    assert 20 <= start <= 70, (start, end)
    assert end - start >= 15, (start, end)
    tokenizer = json.loads((tmp_path / "sft-demo" / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "BPE" and (tmp_path / "sft-demo" / "chat_template.jinja").is_file()
