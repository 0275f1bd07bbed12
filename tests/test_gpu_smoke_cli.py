"""bench/gpu_smoke.py where there is no GPU: its command line, its skip messages, the offline DeepEP build it
would run, and its trainer step on the CPU side (the GPU side runs on a device machine)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import gpu_smoke  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the sections run instead of skipping")
def test_without_a_gpu_every_section_says_why_and_nothing_fails(tmp_path, capsys):
    out = tmp_path / "smoke.jsonl"
    assert gpu_smoke.main(["--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("section") for r in lines[:-1]] == list(gpu_smoke.SECTIONS)
    assert all(r["skipped"].startswith("no CUDA GPU here") for r in lines[:-1])
    assert lines[-1] == {"summary": {"failed": [], "skipped": list(gpu_smoke.SECTIONS)}}
    assert capsys.readouterr().out.count("\n") == len(lines)


def test_sections_are_chosen_by_name(capsys):
    assert gpu_smoke.parse_args(["--only", "deepep"]).sections == ["deepep"]
    with pytest.raises(SystemExit) as stop:
        gpu_smoke.parse_args(["--only", "engine,sglang"])
    assert stop.value.code == 2
    assert "unknown section(s) sglang; choose from engine, trainer, deepep, sharded, weights" in capsys.readouterr().err


def test_deepep_is_built_offline_into_the_ignored_folder(tmp_path):
    command = gpu_smoke.deepep_build_command(tmp_path / "DeepEP", gpu_smoke.DEEPEP_SITE)
    assert {"--no-build-isolation", "--no-deps", "--no-index"} <= set(command)
    assert command[command.index("--target") + 1] == str(gpu_smoke.DEEPEP_SITE)
    if (REPO / ".git").exists():  # a checkout (a source archive has no .gitignore to hold to)
        ignored = subprocess.run(["git", "check-ignore", "-q", str(gpu_smoke.DEEPEP_SITE)], cwd=REPO)
        assert ignored.returncode == 0, ".gpu/ must be git-ignored: nothing of DeepEP is committed"
    module, why = gpu_smoke.import_or_build_deep_ep(tmp_path / "empty")
    if module is None:  # no deep_ep here: the reason names what to bring
        assert "DEEPEP_COMMIT" in why and "--deepep-src" in why


def test_the_trainer_step_it_compares_runs_on_cpu(tmp_path):
    directory = gpu_smoke.demo_checkpoint(tmp_path / "ckpt")
    after, loss = gpu_smoke.one_trainer_step(directory, "cpu", autocast_bf16=False)
    again, loss_again = gpu_smoke.one_trainer_step(directory, "cpu", autocast_bf16=False)
    assert math.isfinite(loss) and loss == loss_again
    assert all(torch.equal(after[n], again[n]) for n in after)  # the CPU reference is reproducible


def test_the_in_place_update_it_checks_runs_on_cpu():
    """The weights section's own code on the CPU: an engine brought from v0 to v1 in place generates what an
    engine opened on v1 does (fp32 and bf16)."""
    result = gpu_smoke.weights_check(prompt_count=4, samples=2, new_tokens=4, device="cpu")
    assert result["ok"] and result["float32"]["identical"] and result["bfloat16"]["identical"]


def test_the_sharded_section_runs_its_check_on_the_cpu(monkeypatch):
    """The sharded section's own function on the CPU (gloo, a 1-rank world): FSDP2 forced over it with activation
    checkpointing gives the plain step's weights, and the grouped GEMM is used and agrees in bf16; on a GPU the
    same code runs on CUDA (NCCL, grouped_mm's CUDA kernel)."""
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the process group's store on a free port, gone after the test
    monkeypatch.setenv("MASTER_PORT", str(gpu_smoke.free_port()))
    result = gpu_smoke.sharded_check("cpu")
    assert not dist.is_initialized()  # the world it made is gone
    assert result["fsdp_checkpointing_step"]["ok"], result
    assert result["grouped_gemm_bf16"]["grouped_mm_used"] and result["grouped_gemm_bf16"]["ok"], result
    assert result["ok"]
