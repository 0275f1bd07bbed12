"""Precision: a bf16 SFT checkpoint stays bf16 through import -> update -> publish -> resume (config.json and every
tensor, half the bytes of fp32); the fp32 master weights travel in the optimizer state and the next update resumes
from them, not from the rounded published weights. The proof: a bf16 run trains exactly the weights of the same run
kept in fp32 (its masters are them bit for bit, its published weights them rounded), with a 2-rank expert-parallel
update and with an update that was killed and restarted. Missing masters are refused, never trained around."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from experience_helpers import make_run, tiny_model, write_checkpoint
from faults_helpers import kill_at, run, step_env
from safetensors.torch import load_file, save_file
from test_bad_input import assert_refused, step
from test_update_experience import experience_table, start_ranks, wait_ranks, write_experience
from transformers import AutoModelForCausalLM

from steps import update
from steps.errors import MoerlError
from steps.models.hf_checkpoint import checkpoint_dtype, load_state_dict_from_dir, tensor_index
from steps.publish import publish
from steps.run import candidate, checkpoint
from steps.run import keys as run_store
from steps.run.candidate import CANDIDATE_INDEX, MARKER
from steps.run.keys import candidate_prefix, optimizer_prefix
from steps.store.object_store import Store
from steps.update import run_update

# Two optimizer steps a update, the KL penalty against v000000 on: the reference policy is read from bf16 too.
# router: train, so that every parameter (the routers too) carries AdamW state and a master
TRAINER = {"ep_backend": "alltoall", "micro_batch_size": 4, "lr": 1e-2, "steps_per_epoch": 2, "kl_coef": 0.05,
           "router": "train"}


def experience(iteration: int):
    return experience_table(policy_version=iteration - 1, prompts=8, group=4, seed=iteration)


def published_tensors(run_uri: str, version: int) -> dict[str, torch.Tensor]:
    return load_state_dict_from_dir(checkpoint.fetch(Store.open(run_uri), version))


def optimizer_tensors(run_uri: str, version: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of <run>/optimizer/v(version)/, whichever EP rank's file holds it."""
    store, out = Store.open(run_uri), {}
    for key in store.list(f"{optimizer_prefix(version)}/"):
        if key.endswith(".safetensors"):
            local = tmp_path / f"{version}-{Path(key).name}"
            store.get_file(key, local)
            out.update(load_file(local))
    return out


def data_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensor data: the file less its 8-byte length and JSON header."""
    (header,) = struct.unpack("<Q", path.read_bytes()[:8])
    return path.stat().st_size - 8 - header


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The same tiny model as a bf16 run and, stored in fp32 (the bf16 values exactly), as an fp32 run; both
    trained on the same experience: iteration 1 by a 2-rank EP update, iteration 2 by one rank. The bf16 run's
    iteration 2 also runs again (--force), is killed once it has uploaded its optimizer shard, and restarts."""
    base = tmp_path_factory.mktemp("precision")
    model = tiny_model(seed=0).to(torch.bfloat16)
    sft_bf16 = write_checkpoint(model, base / "sft-bf16")
    sft_fp32 = write_checkpoint(model.float(), base / "sft-fp32")
    uris = {"bf16": make_run(base, sft_bf16, "bf16", trainer=TRAINER),
            "fp32": make_run(base, sft_fp32, "fp32", trainer=TRAINER)}  # fmt: skip
    for uri in uris.values():
        write_experience(uri, 1, experience(1))
        for code, _, err in wait_ranks(start_ranks(uri, 1, 2)):
            assert code == 0, err[-3000:]
        publish(uri, 1)
        write_experience(uri, 2, experience(2))

    run_update(uris["fp32"], 2)
    publish(uris["fp32"], 2)

    bf16, store = uris["bf16"], Store.open(uris["bf16"])
    run_update(bf16, 2)
    uninterrupted = store.get_json(f"{candidate_prefix(2)}/{MARKER}")["files"]
    argv = [sys.executable, "-m", "steps.update", "--run", bf16, "--iteration", "2", "--force"]
    killed = run(argv, step_env(kill_at("put", r"^candidates/iter-000002/optimizer-")))
    partial = store.list(f"{candidate_prefix(2)}/")
    run_update(bf16, 2)
    restarted = store.get_json(f"{candidate_prefix(2)}/{MARKER}")["files"]
    publish(bf16, 2)
    return {**uris, "killed": killed, "partial": partial, "uninterrupted": uninterrupted, "restarted": restarted}


def test_every_version_keeps_the_sft_checkpoints_dtype(runs):
    for name, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        store = Store.open(runs[name])
        assert checkpoint.published_versions(store) == [0, 1, 2]
        for version in (0, 1, 2):
            directory = checkpoint.fetch(store, version)
            config = json.loads((directory / "config.json").read_text())
            assert config["dtype"] == config["torch_dtype"] == dtype, (name, version)
            assert checkpoint_dtype(directory) == getattr(torch, dtype)
            assert {e.dtype for e in tensor_index(directory).values()} == {"BF16" if name == "bf16" else "F32"}
    # What a server with dtype auto reads: transformers (and SGLang, from the same config.json field) serve bf16.
    v2 = checkpoint.fetch(Store.open(runs["bf16"]), 2)
    assert AutoModelForCausalLM.from_pretrained(v2, dtype="auto").dtype == torch.bfloat16


def test_a_bf16_version_takes_half_the_bytes_of_fp32(runs):
    for version in (1, 2):
        dirs = {name: checkpoint.fetch(Store.open(runs[name]), version) for name in ("bf16", "fp32")}
        numel = sum(t.numel() for t in published_tensors(runs["bf16"], version).values())
        sizes = {}
        for name, directory in dirs.items():
            files = sorted(directory.glob("*.safetensors"))
            assert len(files) == (2 if version == 1 else 1)  # one file per EP rank of the update
            assert sum(data_bytes(f) for f in files) == (2 if name == "bf16" else 4) * numel
            sizes[name] = sum(f.stat().st_size for f in files)
        assert 0.45 < sizes["bf16"] / sizes["fp32"] < 0.55
    index = json.loads((dirs["bf16"].parent / "v000001" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * index["metadata"]["total_parameters"]


def test_the_fp32_masters_travel_in_the_optimizer_state(runs, tmp_path):
    for version in (1, 2):
        weights = published_tensors(runs["bf16"], version)
        state = optimizer_tensors(runs["bf16"], version, tmp_path)
        rounded = 0
        for name, weight in weights.items():
            master = state[f"{name}.master"]
            assert master.dtype == torch.float32 and master.shape == weight.shape, name
            assert torch.equal(master.to(torch.bfloat16), weight), name  # published = the master, rounded
            assert state[f"{name}.exp_avg"].dtype == torch.float32
            rounded += int(not torch.equal(master, weight.float()))
        assert rounded > len(weights) // 2  # most masters hold bits that the bf16 weights have lost
        assert not [n for n in optimizer_tensors(runs["fp32"], version, tmp_path) if n.endswith(".master")]


def test_a_bf16_run_trains_exactly_the_weights_of_the_run_kept_in_fp32(runs, tmp_path):
    """Resuming from the masters loses nothing: iteration 2 of the bf16 run starts from v000001's fp32 masters
    (from the rounded weights it would train other bits), so its masters stay the fp32 run's weights."""
    for version in (1, 2):
        fp32 = published_tensors(runs["fp32"], version)
        bf16 = published_tensors(runs["bf16"], version)
        state = optimizer_tensors(runs["bf16"], version, tmp_path)
        fp32_state = optimizer_tensors(runs["fp32"], version, tmp_path)
        for name, weight in fp32.items():
            assert torch.equal(state[f"{name}.master"], weight), name
            assert torch.equal(bf16[name], weight.to(torch.bfloat16)), name
            for field in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(state[f"{name}.{field}"], fp32_state[f"{name}.{field}"]), (name, field)
    moved = published_tensors(runs["fp32"], 2)
    assert any(not torch.equal(moved[n], t) for n, t in published_tensors(runs["fp32"], 1).items())


def test_a_killed_update_restarts_from_the_masters_to_the_same_bits(runs):
    assert runs["killed"].returncode == -9, runs["killed"].stderr[-2000:]
    partial = {Path(k).name for k in runs["partial"]}
    # killed after its optimizer shard: the weights' marker is there, CANDIDATE.json is not (trained again)
    assert {candidate.model_shard_name(0, 1), candidate.optimizer_shard_name(0, 1), candidate.WEIGHTS_MARKER} <= partial
    assert candidate.MARKER not in partial
    assert runs["restarted"] == runs["uninterrupted"]  # every file bit-identical


# --- the masters are required ------------------------------------------------------------------------------


@pytest.fixture
def bf16_run(tmp_path) -> str:
    """A bf16 run with its first update's candidate written (not yet published)."""
    uri = make_run(tmp_path, write_checkpoint(tiny_model(seed=1).to(torch.bfloat16), tmp_path / "sft"), "bf16",
                   trainer=TRAINER)  # fmt: skip
    write_experience(uri, 1, experience(1))
    run_update(uri, 1)
    return uri


def rewrite(store: Store, key: str, edit, local: Path) -> None:
    """Change one stored file with edit(local path) and, for a candidate file, record its new digest in the
    marker: a consistent-looking candidate that is wrong only in what edit changed."""
    store.get_file(key, local)
    edit(local)
    store.put_file(key, local)
    if key.startswith(f"{candidate_prefix(1)}/"):
        marker = store.get_json(f"{candidate_prefix(1)}/{MARKER}")
        size, sha = checkpoint.file_digest(local)
        marker["files"][Path(key).name] = {"size": size, "sha256": sha}
        store.put_json(f"{candidate_prefix(1)}/{MARKER}", marker)


def edit_tensors(change):
    def edit(path: Path) -> None:
        tensors = load_file(path)
        save_file(change(tensors), str(path), metadata={"format": "pt"})

    return edit


def edit_json(change):
    return lambda path: path.write_text(json.dumps(change(json.loads(path.read_text()))))


def without_masters(tensors: dict) -> dict:
    return {n: t for n, t in tensors.items() if not n.endswith(".master")}


def test_an_update_whose_parent_has_no_masters_is_refused(bf16_run, tmp_path, monkeypatch, capsys):
    publish(bf16_run, 1)
    store = Store.open(bf16_run)
    shard = f"{optimizer_prefix(1)}/{candidate.optimizer_shard_name(0, 1)}"
    rewrite(store, shard, edit_tensors(without_masters), tmp_path / "opt.safetensors")
    index = f"{optimizer_prefix(1)}/{run_store.OPTIMIZER_INDEX}"
    store.put_json(index, {"weight_map": without_masters(store.get_json(index)["weight_map"])})
    write_experience(bf16_run, 2, experience(2))
    result = step(update, ["--run", bf16_run, "--iteration", "2"], monkeypatch, capsys)
    assert_refused(result, "optimizer/v000001: no fp32 master weights for model.embed_tokens.weight "
                   "(model.embed_tokens.weight.master), whose published weights are narrower than fp32")
    assert not store.list(f"{candidate_prefix(2)}/")


def test_publish_refuses_a_candidate_without_its_masters(bf16_run, tmp_path):
    store = Store.open(bf16_run)
    shard = f"{candidate_prefix(1)}/{candidate.optimizer_shard_name(0, 1)}"
    rewrite(store, shard, edit_tensors(without_masters), tmp_path / "opt.safetensors")

    def unlisted(index: dict) -> dict:
        index["optimizer_map"] = without_masters(index["optimizer_map"])
        return index

    rewrite(store, f"{candidate_prefix(1)}/{CANDIDATE_INDEX}", edit_json(unlisted), tmp_path / CANDIDATE_INDEX)
    with pytest.raises(MoerlError, match=r"the optimizer state lacks the fp32 masters of \d+ bfloat16 weights"):
        publish(bf16_run, 1)
    assert checkpoint.published_versions(store) == [0] and not store.list("optimizer/")


def test_publish_refuses_a_candidate_in_another_dtype_than_the_run(bf16_run, tmp_path):
    store = Store.open(bf16_run)
    shard = f"{candidate_prefix(1)}/{candidate.model_shard_name(0, 1)}"
    rewrite(store, shard, edit_tensors(lambda t: {n: v.float() for n, v in t.items()}), tmp_path / "w.safetensors")
    config = f"{candidate_prefix(1)}/config.json"
    rewrite(store, config, edit_json(lambda c: {**c, "dtype": "float32", "torch_dtype": "float32"}), tmp_path / "c")
    with pytest.raises(MoerlError, match="the weights are float32, but the run's checkpoints are bfloat16"):
        publish(bf16_run, 1)
    assert checkpoint.published_versions(store) == [0]


# --- import-sft records the dtype ------------------------------------------------------------------------


def test_import_records_the_dtype_a_config_does_not_declare(tmp_path):
    sft = write_checkpoint(tiny_model(seed=2).to(torch.float16), tmp_path / "sft")
    config = json.loads((sft / "config.json").read_text())
    del config["dtype"], config["torch_dtype"]
    (sft / "config.json").write_text(json.dumps(config))
    uri = make_run(tmp_path, sft)
    first = checkpoint.read_manifest(Store.open(uri), 0)
    v0 = checkpoint.fetch(Store.open(uri), 0)
    recorded = json.loads((v0 / "config.json").read_text())
    assert recorded == {**config, "dtype": "float16", "torch_dtype": "float16"}
    assert checkpoint_dtype(v0) == torch.float16
    make_run(tmp_path, sft)  # importing the same checkpoint again changes nothing
    assert checkpoint.read_manifest(Store.open(uri), 0).same_content(first)
