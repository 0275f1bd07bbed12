"""import-sft: a valid checkpoint becomes v000000 (idempotently); every bad input is one clear error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from steps.demo.char_tokenizer import VOCAB_SIZE, save_tokenizer
from steps.errors import MoerlError
from steps.import_sft import import_sft
from steps.models.hf_checkpoint import save_pretrained
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.run import checkpoint
from steps.store.object_store import Store

REPO = Path(__file__).resolve().parents[1]


def tiny_checkpoint(directory: Path) -> Path:
    torch.manual_seed(0)
    config = MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
    )  # fmt: skip
    save_pretrained(MoeForCausalLM(config), directory)
    save_tokenizer(directory)
    return directory


def weights_path(directory: Path) -> Path:
    return directory / "model.safetensors"


def edit_weights(directory: Path, edit) -> None:
    tensors = load_file(weights_path(directory))
    edit(tensors)
    save_file(tensors, weights_path(directory))


def run_step(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steps.import_sft", *args], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120,
    )  # fmt: skip


def assert_nothing_published(run_dir: Path) -> None:
    assert not run_dir.exists() or not any(run_dir.rglob("*"))


def test_import_publishes_v0_and_is_idempotent(tmp_path):
    src = tiny_checkpoint(tmp_path / "sft")
    run_dir = tmp_path / "run"
    result = run_step("--src", str(src), "--run", f"file://{run_dir}", "--run-config-json", '{"seed": 1}')
    assert result.returncode == 0, result.stderr
    run = Store.open(str(run_dir))
    assert checkpoint.read_latest(run) == "v000000"
    manifest = checkpoint.require_manifest(run, 0)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest.files)
    assert (manifest.parent, manifest.iteration) == (None, 0)
    assert run.get_json("run.json") == {"seed": 1}

    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    again = import_sft(str(src), str(run_dir), '{"seed": 1}')
    assert again.created_at == manifest.created_at
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_subfolders_of_a_hub_repository_stay_behind(tmp_path, capsys):
    """gpt-oss's Hub repository holds original/ and metal/ (the same weights in other formats): not imported."""
    src = tiny_checkpoint(tmp_path / "sft")
    (src / "original").mkdir()
    (src / "original" / "model.safetensors").write_bytes(b"other format")
    import_sft(str(src), str(tmp_path / "run"))
    assert "1 files in subfolders (original/) not imported" in capsys.readouterr().out
    manifest = checkpoint.require_manifest(Store.open(str(tmp_path / "run")), 0)
    assert not [name for name in manifest.files if "/" in name]


def test_imported_checkpoint_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint(tmp_path / "sft")
    import_sft(str(src), str(tmp_path / "run"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "v000000")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_different_checkpoint_into_same_run_is_refused(tmp_path):
    src = tiny_checkpoint(tmp_path / "sft")
    import_sft(str(src), str(tmp_path / "run"))
    edit_weights(src, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"] + 1))
    with pytest.raises(MoerlError, match="already published with different content"):
        import_sft(str(src), str(tmp_path / "run"))


def test_conflicting_run_config_is_refused(tmp_path):
    src = tiny_checkpoint(tmp_path / "sft")
    import_sft(str(src), str(tmp_path / "run"), '{"seed": 1}')
    with pytest.raises(MoerlError, match="already holds a different config"):
        import_sft(str(src), str(tmp_path / "run"), '{"seed": 2}')


def break_missing_config(d: Path) -> None:
    (d / "config.json").unlink()


def break_dense(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    del config["num_experts"]
    (d / "config.json").write_text(json.dumps(config))


def break_missing_tensor(d: Path) -> None:
    edit_weights(d, lambda t: t.pop("model.layers.0.mlp.experts.3.down_proj.weight"))


def break_misshaped_tensor(d: Path) -> None:
    edit_weights(d, lambda t: t.__setitem__("model.layers.0.mlp.gate.weight", torch.zeros(5, 16)))


def break_pickle_only(d: Path) -> None:
    weights_path(d).unlink()
    (d / "pytorch_model.bin").write_bytes(b"not unpickled, ever")


def break_missing_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (break_missing_config, "missing config.json"),
        (break_dense, "Qwen3-MoE"),
        (break_missing_tensor, "tensor model.layers.0.mlp.experts.3.down_proj.weight is missing"),
        (break_misshaped_tensor, r"tensor model.layers.0.mlp.gate.weight has shape \[5, 16\]"),
        (break_pickle_only, "safetensors only"),
        (break_missing_tokenizer, "missing tokenizer.json"),
    ],
    ids=["missing-config", "dense", "missing-tensor", "misshaped-tensor", "pickle-only", "no-tokenizer"],
)
def test_bad_checkpoint_is_one_clear_error_and_nothing_published(tmp_path, breakage, message):
    src = tiny_checkpoint(tmp_path / "sft")
    breakage(src)
    result = run_step("--src", str(src), "--run", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message.replace("\\", "") in lines[0] or __import__("re").search(message, lines[0]), lines[0]
    assert_nothing_published(tmp_path / "run")


def test_import_from_and_to_s3(tmp_path, s3_env):
    bucket = s3_env.create_bucket()
    src = tiny_checkpoint(tmp_path / "sft")
    Store.open(f"s3://{bucket}/sft").upload_dir(src, "")
    import_sft(f"s3://{bucket}/sft", f"s3://{bucket}/runs/r1")
    run = Store.open(f"s3://{bucket}/runs/r1")
    assert checkpoint.read_latest(run) == "v000000"
    out = checkpoint.download(run, 0, tmp_path / "back")
    assert (out / "model.safetensors").read_bytes() == weights_path(src).read_bytes()


def test_unreachable_bucket_is_one_clear_error(tmp_path, s3_env):
    src = tiny_checkpoint(tmp_path / "sft")
    result = run_step("--src", str(src), "--run", "s3://no-such-bucket-moerl/run")
    assert result.returncode == 2
    assert "no-such-bucket-moerl" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_wrong_credentials_is_one_clear_error(tmp_path, s3_env, monkeypatch):
    bucket = s3_env.create_bucket()
    src = tiny_checkpoint(tmp_path / "sft")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with s3_env.iam_auth(), pytest.raises(MoerlError) as err:
        import_sft(str(src), f"s3://{bucket}/run")
    assert f"s3://{bucket}/run" in str(err.value)
    assert "AWS_ACCESS_KEY_ID" in str(err.value) or "credentials" in str(err.value)
    assert s3_env.s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
