"""A checkpoint's config.json in transformers' older layout (top-level rope_theta, torch_dtype, no
rope_parameters, as the public Qwen3-30B-A3B config.json is): every published version keeps it as the user gave
it, and an SGLang engine started on it takes in-place updates of the same model whatever layout their
config.json has (SGLang never re-reads config.json: the check is moerl's, on what the model's shape and
computation depend on)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from delta_helpers import moved
from experience_helpers import tiny_model, write_checkpoint
from test_engine_sglang import update_with_fake_sglang
from test_update_experience import experience_table, write_experience

from steps.demo.char_tokenizer import save_tokenizer
from steps.errors import MoerlError
from steps.import_sft import import_sft
from steps.models.hf_checkpoint import model_architecture, save_pretrained
from steps.publish import publish
from steps.run import checkpoint
from steps.run.candidate import MARKER
from steps.run.config import RunConfig
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store
from steps.update import run_update

ROPE_THETA = 1_000_000.0  # Qwen3-30B-A3B's; not the default, so where it is read from matters


def older_layout(config: dict, dtype: str) -> dict:
    """What transformers 4.51 wrote for Qwen3-MoE: top-level rope_theta, torch_dtype, no dtype, no
    rope_parameters, no pad_token_id, and its own version."""
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype", "pad_token_id")}
    return old | {"torch_dtype": dtype, "transformers_version": "4.51.0"}


def newer_layout(config: dict, dtype: str) -> dict:
    """transformers v5: rope_parameters, dtype, and no top-level rope_theta or torch_dtype."""
    new = {k: v for k, v in config.items() if k not in ("rope_theta", "torch_dtype")}
    return new | {"dtype": dtype, "transformers_version": "5.0.0"}


def rewrite_config(directory: Path, edit) -> dict:
    config = edit(json.loads((directory / "config.json").read_text()))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def test_the_layouts_of_one_model_compare_equal_and_another_model_does_not():
    config = tiny_model(rope_theta=ROPE_THETA).config.to_hf_dict(torch.bfloat16)
    old, new = older_layout(config, "bfloat16"), newer_layout(config, "bfloat16")
    assert "rope_parameters" not in old and "rope_theta" not in new
    assert model_architecture(old) == model_architecture(new) == model_architecture(config)
    assert model_architecture(old)["rope_theta"] == ROPE_THETA
    other_rope = new | {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    assert model_architecture(other_rope) != model_architecture(old)
    assert model_architecture(old | {"num_experts": 8}) != model_architecture(old)


def test_sglang_updates_a_model_started_on_the_older_layout_in_place(tmp_path):
    """v000000 as the user gave it (older layout); later versions' config.json in the newer layout or as
    MoeConfig.to_hf_dict writes it: the same model, so SGLang's update_weights_from_disk runs. Another rope
    theta is another model (SGLang would keep serving the old one): refused before SGLang sees it."""
    model = tiny_model(seed=3, rope_theta=ROPE_THETA).to(torch.bfloat16)
    v0 = write_checkpoint(model, tmp_path / "v0")
    rewrite_config(v0, lambda c: older_layout(c, "bfloat16"))
    newer = write_checkpoint(moved(model, seed=1), tmp_path / "newer")
    rewrite_config(newer, lambda c: newer_layout(c, "bfloat16"))
    regenerated = write_checkpoint(moved(model, seed=2), tmp_path / "regenerated")  # to_hf_dict's own
    other_rope = write_checkpoint(moved(model, seed=3), tmp_path / "other-rope")
    rewrite_config(other_rope, lambda c: newer_layout(c, "bfloat16") | {"rope_parameters": {"rope_theta": 1e4}})

    said = update_with_fake_sglang(v0, {"newer": newer, "regenerated": regenerated, "other_rope": other_rope})
    assert said["newer"] == "ok" and said["regenerated"] == "ok", said
    assert said["updates"] == [str(newer), str(regenerated)]
    assert "another model or dtype than this SGLang engine serves" in said["other_rope"]
    assert said["generate"] == "ok"


def older_layout_run(tmp_path: Path) -> tuple[str, bytes]:
    """A run whose SFT checkpoint's config.json is in the older layout; (run URI, that file's bytes)."""
    sft = tmp_path / "sft"
    save_pretrained(tiny_model(rope_theta=ROPE_THETA), sft)
    save_tokenizer(sft)
    rewrite_config(sft, lambda c: older_layout(c, "float32"))
    run_uri = (tmp_path / "run").as_uri()
    cfg = RunConfig(
        sft_checkpoint=sft.as_uri(), run_store=run_uri,
        trainer={"ep_backend": "alltoall", "micro_batch_size": 4, "lr": 1e-2},
    )  # fmt: skip
    import_sft(sft.as_uri(), run_uri, cfg.model_dump_json())
    return run_uri, (sft / "config.json").read_bytes()


def test_every_published_version_keeps_the_users_config_json(tmp_path):
    run_uri, users = older_layout_run(tmp_path)
    run = Store.open(run_uri)
    assert checkpoint.read_file(run, 0, "config.json") == users  # a declared dtype: imported verbatim
    for iteration in (1, 2):
        write_experience(run_uri, iteration, experience_table(policy_version=iteration - 1))
        run_update(run_uri, iteration)
        regenerated = json.loads(run.get_bytes(f"{candidate_prefix(iteration)}/config.json"))
        assert "rope_parameters" in regenerated  # what the update writes (MoeConfig.to_hf_dict) ...
        publish(run_uri, iteration)
        assert checkpoint.read_file(run, iteration, "config.json") == users  # ... is never what is published
    assert load_config_of(run, 2)["rope_theta"] == ROPE_THETA and "rope_parameters" not in load_config_of(run, 2)


def load_config_of(run: Store, version: int) -> dict:
    return json.loads(checkpoint.read_file(run, version, "config.json"))


def test_a_candidate_whose_config_describes_another_model_is_refused(tmp_path):
    run_uri, _ = older_layout_run(tmp_path)
    run = Store.open(run_uri)
    write_experience(run_uri, 1, experience_table(policy_version=0))
    run_update(run_uri, 1)
    key = f"{candidate_prefix(1)}/config.json"
    config = json.loads(run.get_bytes(key)) | {"rms_norm_eps": 1e-5}
    data = (json.dumps(config, indent=2) + "\n").encode()
    marker = run.get_json(f"{candidate_prefix(1)}/{MARKER}")
    marker["files"]["config.json"] = {"size": len(data), "sha256": run.put_bytes(key, data)}
    run.put_json(f"{candidate_prefix(1)}/{MARKER}", marker)
    with pytest.raises(MoerlError, match="config.json: describes another model than v000000"):
        publish(run_uri, 1)
    assert checkpoint.published_versions(run) == [0]
