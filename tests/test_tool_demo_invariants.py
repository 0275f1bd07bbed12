"""The tool demo's invariants (configs/demo-tool.yaml: multi-turn conversations with a calculator environment):
chaos (Spot preemptions and a hard kill), the number of rollout shards and rollout servers that take each turn from
the clients change nothing in the final weights; and the demo as a user runs it raises held-out accuracy by 15
points."""

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.config import load_config
from pipelines.demo import demo_sft_settings, run_config
from pipelines.sft_demo import sft_demo

REPO = Path(__file__).resolve().parents[1]
TOOL_CONFIG = REPO / "configs" / "demo-tool.yaml"
TINY = {"iterations": 2, "prompts_per_iteration": 8, "group_size": 4, "heldout_size": 8, "rollout.chunk_size": 2,
        "environment.workers": 2}  # fmt: skip


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    """A tool-demo checkpoint trained briefly: it writes calls, some right, so conversations take two turns."""
    out = tmp_path_factory.mktemp("sft") / "sft-demo"
    settings = demo_sft_settings(load_config(TOOL_CONFIG, {"sft_checkpoint": "x", "run_store": "y"}), seed=0)
    sft_demo(str(out), dataclasses.replace(settings, steps=60, eval_prompts=16))
    return out


def final_weights(sft_dir: Path, workdir: Path, chaos: str | None = None, **overrides) -> dict[str, str]:
    config = {**TINY, "sft_checkpoint": str(sft_dir), "run_store": str(workdir / "run"), **overrides}
    result = run_config(load_config(TOOL_CONFIG, config), workdir, chaos)
    assert result.succeeded, (result.phase, result.message)
    final = workdir / "run" / "checkpoints" / "v000002"
    assert (final / "MANIFEST.json").is_file()
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(final.glob("*.safetensors"))}


@pytest.mark.faults
def test_chaos_shards_and_servers_leave_the_tool_demos_final_weights_bit_identical(sft_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")  # retry backoffs and grace periods, not the steps
    baseline = final_weights(sft_dir, tmp_path / "plain")
    score = json.loads((tmp_path / "plain" / "run" / "metrics" / "iter-000001.json").read_text())
    assert score["turns_mean"] > 1 and score["env/tool_calls"] > 0  # conversations, not single turns
    assert final_weights(sft_dir, tmp_path / "chaos", chaos="preempt=2,kill=1,seed=5") == baseline
    assert final_weights(sft_dir, tmp_path / "one-shard", **{"rollout.num_shards": 1}) == baseline
    # the environment on the clients, each turn on a server (POST /generate)
    served = {"rollout.servers": 1, "rollout.num_shards": 2, "rollout.server_wait_s": 300}
    assert final_weights(sft_dir, tmp_path / "served", **served) == baseline


def test_the_tool_demo_raises_heldout_accuracy_by_15_points(tmp_path):
    # `moerl demo --config configs/demo-tool.yaml`, as README names it (bench/README.md, "tool demo": seeds 0-4)
    result = subprocess.run(
        [sys.executable, "-c", "from pipelines.cli import main; main()", "demo", "--config", str(TOOL_CONFIG),
         "--workdir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    print(report)
    outcome = re.search(r"held-out accuracy ([\d.]+)% \(v000000.*\) -> ([\d.]+)% \(v000008\)", report)
    assert outcome, report
    start, end = float(outcome[1]), float(outcome[2])
    assert 20 <= start <= 75, (start, end)
    assert end - start >= 15, (start, end)
