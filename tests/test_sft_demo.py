"""moerl sft-demo: a deterministic, importable demo checkpoint whose accuracy leaves room for RL."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.sft_demo import sft_demo
from steps.demo.sft import SftSettings
from steps.models.checkpoint_validation import validate_checkpoint_dir

REPO = Path(__file__).resolve().parents[1]


def digest(directory: Path) -> str:
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()


def test_sft_demo_is_deterministic_for_a_seed(tmp_path):
    settings = SftSettings(steps=8, eval_prompts=16, train_prompts=256)
    sft_demo(str(tmp_path / "a"), settings)
    sft_demo(str(tmp_path / "b"), settings)
    sft_demo(str(tmp_path / "c"), SftSettings(steps=8, eval_prompts=16, train_prompts=256, seed=1))
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert digest(tmp_path / "a") != digest(tmp_path / "c")
    config = validate_checkpoint_dir(tmp_path / "a")
    assert config.num_experts >= 8 and config.num_experts_per_tok == 2


def test_sft_demo_accuracy_leaves_room_for_rl(tmp_path):
    """The default settings, through the real command line: 20-60% held-out exact match, printed."""
    result = subprocess.run(
        [sys.executable, "-c", "from pipelines.cli import main; main()", "sft-demo", "--out", str(tmp_path / "sft")],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "held-out exact match" in line)
    accuracy = float(line.split("held-out exact match ")[1].split("%")[0]) / 100
    assert 0.2 <= accuracy <= 0.6, line
    params = float(line.split("sft-demo: ")[1].split("M parameters")[0])
    assert 0.2 <= params <= 2.0, line


def test_sft_demo_refuses_a_bad_output_uri(tmp_path):
    from steps.errors import MoerlError

    with pytest.raises(MoerlError, match="s3://"):
        sft_demo("s3://Bad_Bucket!/x", SftSettings(steps=1))
