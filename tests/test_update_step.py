"""The update step under torchrun (2 gloo ranks, EP=2) and publish: a candidate with one expert shard per EP
rank, published as a checkpoint transformers loads; and the bad inputs that must end with a clear message
and nothing published."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_update_experience import (
    experience_table,
    make_run,
    run_cmd,
    start_ranks,
    torchrun_update,
    wait_ranks,
    write_experience,
)

from steps.errors import MoerlError
from steps.models.hf_checkpoint import load_pretrained
from steps.models.placement import is_expert_param
from steps.publish import publish
from steps.run import checkpoint
from steps.run.candidate import CANDIDATE_INDEX, MARKER, model_shard_name
from steps.run.keys import candidate_prefix, update_metrics_key
from steps.store.object_store import Store
from steps.update import run_update

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def assert_nothing_published(run: Store, iteration: int = 1) -> None:
    assert checkpoint.published_versions(run) == [0]
    assert checkpoint.read_latest(run) == "v000000"
    assert not run.exists(f"{candidate_prefix(iteration)}/{MARKER}")
    with pytest.raises(MoerlError, match="no complete candidate"):
        publish(run.uri, iteration)


def test_two_rank_update_then_publish_gives_a_checkpoint_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    run_uri = make_run(tmp_path)
    run = Store.open(run_uri)
    write_experience(run_uri, 1, experience_table(policy_version=0, prompts=4, group=4))
    done = run_cmd(torchrun_update(run_uri, 1, 2))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iteration 1: loss" in done.stdout and "ep 2" in done.stdout

    # The candidate: one weight and one optimizer shard per EP rank, each rank's own experts only.
    marker = run.get_json(f"{candidate_prefix(1)}/{MARKER}")
    assert (marker["iteration"], marker["parent"], marker["ep_size"], marker["world_size"]) == (1, 0, 2, 2)
    shard_files = [model_shard_name(r, 2) for r in range(2)]
    assert set(shard_files) | {"optimizer-rank00000-of-00002.safetensors", CANDIDATE_INDEX} <= set(marker["files"])
    run.get_file(f"{candidate_prefix(1)}/{shard_files[1]}", tmp_path / "rank1.safetensors")
    with safe_open(str(tmp_path / "rank1.safetensors"), framework="pt") as f:
        rank1 = set(f.keys())
    assert rank1 and all(is_expert_param(n) and (".experts.2." in n or ".experts.3." in n) for n in rank1)
    metrics = run.get_json(update_metrics_key(1))["update"]
    for key in ("loss", "clip_fraction", "kl", "is_weight", "grad_norm", "entropy", "tokens_per_s"):
        assert key in metrics
    assert metrics["sequences"] == 16 and metrics["tokens_per_s"] > 0

    manifest = publish(run_uri, 1)
    assert (manifest.version, manifest.parent, manifest.iteration) == (1, 0, 1)
    assert checkpoint.read_latest(run) == "v000001"
    assert not run.list(candidate_prefix(1))  # the published candidate is cleaned up
    assert run.exists("optimizer/v000001/optimizer.index.json")
    assert publish(run_uri, 1).same_content(manifest)  # idempotent

    v0, v1 = checkpoint.fetch(run, 0), checkpoint.fetch(run, 1)
    assert sorted(p.name for p in v1.glob("model*")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    ]  # fmt: skip
    index = json.loads((v1 / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.0.mlp.experts.3.up_proj.weight"] == "model-00002-of-00002.safetensors"
    trained, before = load_pretrained(v1), load_pretrained(v0)
    changed = [n for n, t in trained.state_dict().items() if not torch.equal(t, before.state_dict()[n])]
    assert any(is_expert_param(n) for n in changed) and "lm_head.weight" in changed

    hf = AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 7, 30, 12, 2]])
    with torch.no_grad():
        torch.testing.assert_close(trained(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_nan_loss_on_two_ranks_stops_both_and_publishes_nothing(tmp_path):
    run_uri = make_run(tmp_path)
    run = Store.open(run_uri)
    # A poisoned input checkpoint: a NaN in the output head makes the loss NaN on every rank.
    v0 = run.child("checkpoints/v000000")
    local = tmp_path / "v0.safetensors"
    v0.get_file("model.safetensors", local)
    tensors = load_file(local)
    tensors["lm_head.weight"][3, 0] = float("nan")
    save_file(tensors, str(local), metadata={"format": "pt"})
    v0.put_file("model.safetensors", local)
    manifest = run.get_json("checkpoints/v000000/MANIFEST.json")
    manifest["files"]["model.safetensors"] = dict(zip(("size", "sha256"), checkpoint.file_digest(local), strict=True))
    v0.put_json("MANIFEST.json", manifest)
    write_experience(run_uri, 1, experience_table(policy_version=0))

    for code, _, err in wait_ranks(start_ranks(run_uri, 1, 2)):  # both ranks stop, neither hangs
        assert code == 2
        assert "error: the policy loss is nan (not finite); nothing was written" in err
    assert_nothing_published(run)
    assert not run.list(candidate_prefix(1))


def test_missing_experience_is_a_clear_cli_error(tmp_path):
    run_uri = make_run(tmp_path)
    done = run_cmd([sys.executable, "-m", "steps.update", "--run", run_uri, "--iteration", "1"])
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "iter-000001/scored.parquet: no scored experience" in done.stderr
    assert_nothing_published(Store.open(run_uri))


def test_experience_of_an_unexpected_policy_version_is_refused(tmp_path):
    run_uri = make_run(tmp_path, staleness=1)
    # staleness 1: iteration 2 trains on samples of v000000, not v000001
    write_experience(run_uri, 1, experience_table(policy_version=0))
    run_update(run_uri, 1)
    publish(run_uri, 1)
    write_experience(run_uri, 2, experience_table(policy_version=1))
    with pytest.raises(MoerlError, match=r"policy version\(s\) \[1\].*v000000"):
        run_update(run_uri, 2)
    run = Store.open(run_uri)
    assert checkpoint.published_versions(run) == [0, 1] and checkpoint.read_latest(run) == "v000001"
    assert not run.exists(f"{candidate_prefix(2)}/{MARKER}")


def test_missing_parent_checkpoint_is_refused(tmp_path):
    run_uri = make_run(tmp_path)
    write_experience(run_uri, 2, experience_table(policy_version=1))
    with pytest.raises(MoerlError, match=r"v000001 is neither published \(no MANIFEST.json\) nor indexed"):
        run_update(run_uri, 2)
    with pytest.raises(MoerlError, match="iterations start at 1"):
        run_update(run_uri, 0)
