"""The demo workflow's invariants: chaos (Spot preemptions and a hard kill) and the number of rollout shards
change nothing in the final weights; `moerl demo` runs end to end and prints its report."""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config import load_config
from pipelines.demo import DEMO_CONFIG, run_config
from pipelines.sft_demo import sft_demo
from steps.sft import SftSettings

REPO = Path(__file__).resolve().parents[1]
TINY = {"iterations": 2, "prompts_per_iteration": 16, "group_size": 4, "heldout_size": 16, "rollout.chunk_size": 4}


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "sft-demo"
    sft_demo(str(out), SftSettings(steps=40, eval_prompts=16))
    return out


def final_weights(sft_dir: Path, workdir: Path, chaos: str | None = None, shards: int = 2) -> dict[str, str]:
    overrides = {**TINY, "sft_checkpoint": str(sft_dir), "run_store": str(workdir / "run")}
    overrides["rollout.num_shards"] = shards
    result = run_config(load_config(DEMO_CONFIG, overrides), workdir, chaos)
    assert result.succeeded, (result.phase, result.message)
    final = workdir / "run" / "checkpoints" / "v000002"
    assert (final / "MANIFEST.json").is_file()
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(final.glob("*.safetensors"))}


@pytest.mark.faults
def test_chaos_and_shard_count_leave_the_final_weights_bit_identical(sft_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")  # retry backoffs and grace periods, not the steps
    baseline = final_weights(sft_dir, tmp_path / "plain")
    assert baseline
    assert final_weights(sft_dir, tmp_path / "chaos", chaos="preempt=3,kill=1,seed=7") == baseline
    assert final_weights(sft_dir, tmp_path / "one-shard", shards=1) == baseline
    assert final_weights(sft_dir, tmp_path / "three-shards", shards=3) == baseline
    status = json.loads((tmp_path / "chaos" / "status.json").read_text())
    retried = [n for n in status["nodes"].values() if n.get("type") == "Retry" and len(n.get("children", [])) > 1]
    assert retried, "chaos injected no fault that the workflow had to retry"


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


def test_the_default_demo_raises_heldout_accuracy_by_15_points(tmp_path):
    # `moerl demo` as `make demo` runs it: the SFT checkpoint built here, configs/demo.yaml unchanged.
    result = subprocess.run(
        [sys.executable, "-c", "from pipelines.cli import main; main()", "demo", "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    outcome = re.search(r"held-out accuracy ([\d.]+)% \(v000000.*\) -> ([\d.]+)% \(v000008\)", report)
    assert outcome, report
    start, end = float(outcome[1]), float(outcome[2])
    assert 20 <= start <= 60, report  # the SFT checkpoint leaves room for RL
    # On this kind of machine the run is bit-reproducible and gives +26.7 points (README). Another CPU's float
    # rounding changes the sampled trajectory, and two seeds of the earlier recipe gave +16.0 and +17.7 on 2048
    # prompts: the bar below catches a recipe that stopped learning without failing on that spread.
    assert end - start >= 12, report


def test_the_chat_demo_raises_heldout_accuracy_by_15_points(tmp_path):
    # `moerl demo --config configs/demo-chat.yaml`: a BPE tokenizer trained on the task's text, a ChatML template,
    # natural-language prompts and the math verifier; measured +33.0 points (52.7% -> 85.7%) in 396 s (bench/README.md)
    result = subprocess.run(
        [sys.executable, "-c", "from pipelines.cli import main; main()", "demo", "--config",
         str(REPO / "configs" / "demo-chat.yaml"), "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    outcome = re.search(r"held-out accuracy ([\d.]+)% \(v000000.*\) -> ([\d.]+)% \(v000008\)", report)
    assert outcome, report
    start, end = float(outcome[1]), float(outcome[2])
    assert 20 <= start <= 70, report
    assert end - start >= 15, report
    tokenizer = json.loads((tmp_path / "sft-demo" / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "BPE" and (tmp_path / "sft-demo" / "chat_template.jinja").is_file()
