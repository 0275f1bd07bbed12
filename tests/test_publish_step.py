"""publish: a verified candidate becomes v(I) (MANIFEST last, LATEST moved, retention applied, optimizer
state kept for the next update); a missing, corrupted or inconsistent candidate is refused with nothing
published; publishing twice changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_update_experience import experience_table, make_run, write_experience

from steps.errors import MoerlError
from steps.models.hf_checkpoint import load_pretrained
from steps.publish import main as publish_main
from steps.publish import publish
from steps.run import checkpoint
from steps.run.candidate import MARKER, model_shard_name, optimizer_shard_name
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store
from steps.update import run_update


def updated_run(tmp_path: Path, **config) -> tuple[str, Store]:
    run_uri = make_run(tmp_path, **config)
    write_experience(run_uri, 1, experience_table(policy_version=0))
    run_update(run_uri, 1)
    return run_uri, Store.open(run_uri)


def rewrite_candidate_file(run: Store, tmp_path: Path, name: str, edit) -> None:
    """Change one candidate file and record its new digest in the marker (a consistent-looking candidate)."""
    key = f"{candidate_prefix(1)}/{name}"
    local = tmp_path / name
    run.get_file(key, local)
    tensors = load_file(local)
    edit(tensors)
    save_file(tensors, str(local), metadata={"format": "pt"})
    run.put_file(key, local)
    marker = run.get_json(f"{candidate_prefix(1)}/{MARKER}")
    size, sha = checkpoint.file_digest(local)
    marker["files"][name] = {"size": size, "sha256": sha}
    run.put_json(f"{candidate_prefix(1)}/{MARKER}", marker)


def assert_nothing_published(run: Store) -> None:
    assert checkpoint.published_versions(run) == [0]
    assert checkpoint.read_latest(run) == "v000000"
    assert not run.list("optimizer/")


def test_single_rank_candidate_publishes_as_one_safetensors_file(tmp_path):
    run_uri, run = updated_run(tmp_path)
    manifest = publish(run_uri, 1)
    assert sorted(manifest.files) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    v1 = checkpoint.fetch(run, 1)
    assert load_pretrained(v1).config == load_pretrained(checkpoint.fetch(run, 0)).config
    assert publish(run_uri, 1).same_content(manifest)


def test_missing_candidate_file_is_refused(tmp_path):
    run_uri, run = updated_run(tmp_path)
    run.delete(f"{candidate_prefix(1)}/{optimizer_shard_name(0, 1)}")
    with pytest.raises(MoerlError, match="listed in CANDIDATE.json but missing"):
        publish(run_uri, 1)
    assert_nothing_published(run)


def test_corrupted_candidate_file_is_refused(tmp_path):
    run_uri, run = updated_run(tmp_path)
    key = f"{candidate_prefix(1)}/{model_shard_name(0, 1)}"
    data = bytearray(run.get_bytes(key))
    data[-1] ^= 0xFF
    run.put_bytes(key, bytes(data))  # the store's own digest follows; the marker's does not
    with pytest.raises(MoerlError, match="size or sha256 differs from CANDIDATE.json"):
        publish(run_uri, 1)
    assert_nothing_published(run)


def test_tensor_with_a_wrong_shape_is_refused(tmp_path):
    run_uri, run = updated_run(tmp_path)

    def shrink(tensors):
        tensors["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.zeros(3, 3)

    rewrite_candidate_file(run, tmp_path, model_shard_name(0, 1), shrink)
    with pytest.raises(MoerlError, match=r"experts.2.up_proj.weight has shape \[3, 3\]"):
        publish(run_uri, 1)
    assert_nothing_published(run)


def test_shard_that_disagrees_with_the_index_is_refused(tmp_path):
    run_uri, run = updated_run(tmp_path)
    rewrite_candidate_file(run, tmp_path, model_shard_name(0, 1), lambda t: t.pop("model.norm.weight"))
    with pytest.raises(MoerlError, match=r"does not match the index .*missing tensors \['model.norm.weight'\]"):
        publish(run_uri, 1)
    assert_nothing_published(run)


def test_publish_without_a_candidate_names_the_update_step(tmp_path, monkeypatch):
    run_uri = make_run(tmp_path)
    monkeypatch.setattr("sys.argv", ["steps.publish", "--run", run_uri, "--iteration", "1"])
    with pytest.raises(MoerlError, match=r"no complete candidate \(CANDIDATE.json missing\).*steps.update"):
        publish_main()


def test_iterations_chain_with_optimizer_state_and_retention(tmp_path):
    run_uri = make_run(tmp_path, checkpoint={"keep_last": 1})
    run = Store.open(run_uri)
    for iteration in (1, 2, 3):
        write_experience(run_uri, iteration, experience_table(policy_version=iteration - 1, seed=iteration))
        assert run_update(run_uri, iteration) is not None
        assert run_update(run_uri, iteration) is None  # a complete candidate: nothing to do
        manifest = publish(run_uri, iteration)
        assert (manifest.version, manifest.parent) == (iteration, iteration - 1)
        # AdamW resumed from the parent's published state: its step count keeps growing
        local = tmp_path / f"opt{iteration}.safetensors"
        run.get_file(f"optimizer/v{iteration:06d}/{optimizer_shard_name(0, 1)}", local)
        with safe_open(str(local), framework="pt") as f:
            assert float(f.get_tensor("lm_head.weight.step")) == iteration
    assert run_update(run_uri, 3) is None  # already published
    # keep_last 1: only the newest version besides v000000 (the KL reference) remains, with its optimizer
    assert checkpoint.published_versions(run) == [0, 3]
    assert checkpoint.read_latest(run) == "v000003"
    assert {k.split("/")[1] for k in run.list("optimizer/")} == {"v000003"}
    assert not run.list("candidates/")
