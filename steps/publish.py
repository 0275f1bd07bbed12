"""Step publish: verify iteration I's candidate and publish it as checkpoint v(I) with parent v(I-1).

    python -m steps.publish --run URI --iteration I

1. Verify <run>/candidates/iter-I/: CANDIDATE.json present (the update finished; while WEIGHTS.json alone
   is, a trainer that stays up still stores the optimizer shards: waited for, at most trainer.publish_wait_s),
   every file it lists present with its size and sha256, candidate.index.json consistent with the shards'
   headers, every tensor of the model exactly once with the shape config.json implies, the optimizer state
   matching the weights.
   The weights must be stored in the run's dtype (the parent's, so v000000's) and, when that is narrower
   than fp32, the optimizer state must hold every parameter's fp32 master (what the next update resumes from).
   config.json is the parent's (so v000000's: the user's own, plus its dtype), never the one the update
   regenerated, which must describe the same model (keep_parent_config).
2. Assemble a Hugging Face checkpoint dir as transformers writes it: config.json, generation_config.json,
   tokenizer files and model.safetensors (one shard) or model-0000k-of-0000n.safetensors +
   model.safetensors.index.json (one shard per EP rank), loadable by transformers and SGLang.
3. With checkpoint.deltas and rollout.servers, v(I)'s delta against v(I-1) at <run>/deltas/v(I)/
   (steps/run/weight_delta.py: what rollout servers fetch instead of the whole checkpoint): the update indexed it
   already (rollout servers may be generating with v(I) from it), and the files published must be exactly those
   its DELTA.json lists, else publish fails before it writes anything (an indexed version is final); a candidate
   the update did not index gets its delta here (the ranks' blobs indexed, else written from both versions).
   Then the optimizer state at <run>/optimizer/v(I)/ (the next update resumes AdamW from it), and the dir with
   steps.run.checkpoint.publish_dir: files, MANIFEST.json last, LATEST moved.
4. Apply retention (checkpoint.keep_last; v000000 is kept as the KL reference), drop the optimizer state
   and the deltas of deleted versions, and delete the candidate.

Idempotent: if v(I) is already published, only steps 3's LATEST move and 4 run again.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from steps import progress
from steps.errors import MoerlError, run_cli
from steps.models.checkpoint_validation import validate_checkpoint_dir
from steps.models.family import dtype_name
from steps.models.hf_checkpoint import (
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFETENSORS_DTYPE_BYTES,
    TensorEntry,
    check_tensors,
    declared_dtype,
    load_config,
    model_architecture,
    parameter_shapes,
    read_config_json,
    weights_dtype,
)
from steps.run import candidate, checkpoint, weight_delta
from steps.run.candidate import CANDIDATE_INDEX, MARKER
from steps.run.config import load_run_config
from steps.run.keys import (
    DELTAS_PREFIX,
    OPTIMIZER_PREFIX,
    candidate_prefix,
    delta_index_key,
    delta_prefix,
    parse_version,
    version_name,
    version_prefix,
)
from steps.store.object_store import Store
from steps.training import publication
from steps.training.optimizer_state import MASTER_FIELD, OPTIMIZER_FIELDS, store_optimizer_state


def _headers(path: Path) -> dict[str, TensorEntry]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                name: TensorEntry(path, tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                for name in f.keys()
            }
    except (SafetensorError, OSError) as err:
        raise MoerlError(f"{path.name}: not a readable safetensors file ({err}); rerun update with --force") from err


def _check_map(kind: str, mapping: dict[str, str], local_dir: Path, where: str) -> dict[str, TensorEntry]:
    """Each file of the map holds exactly the tensors mapped to it; returns name -> TensorEntry."""
    entries: dict[str, TensorEntry] = {}
    for file_name in sorted(set(mapping.values())):
        path = local_dir / file_name
        if not path.is_file():
            raise MoerlError(f"{where}: {kind} shard {file_name} is in the index but not in {MARKER}")
        headers = _headers(path)
        expected = {n for n, f in mapping.items() if f == file_name}
        if set(headers) != expected:
            extra, missing = sorted(set(headers) - expected), sorted(expected - set(headers))
            raise MoerlError(
                f"{where}: {kind} shard {file_name} does not match the index (unlisted tensors {extra[:3]}, "
                f"missing tensors {missing[:3]}); rerun update with --force"
            )
        entries.update(headers)
    return entries


def verify_candidate(
    local_dir: Path, where: str, run_dtype: torch.dtype
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Check the downloaded candidate, whose weights must be stored in `run_dtype` (the parent version's, so
    v000000's); returns (index, model shard files, optimizer shard files)."""
    cfg = load_config(local_dir)
    index = candidate.read_index(local_dir, where)
    weight_map, optimizer_map = index.get("weight_map", {}), index.get("optimizer_map", {})
    weights = _check_map("weight", weight_map, local_dir, where)
    check_tensors(cfg, weights, where)  # every tensor once, with the config's shape, nothing unexpected
    dtype = weights_dtype(read_config_json(local_dir), weights, where)  # one dtype, the one config.json says
    if dtype != run_dtype:
        raise MoerlError(
            f"{where}: the weights are {dtype_name(dtype)}, but the run's checkpoints are {dtype_name(run_dtype)} "
            "(every version keeps the SFT checkpoint's dtype); rerun update with --force"
        )
    shapes = parameter_shapes(cfg)  # optimizer state is named by the model's parameters (buffers have none)
    state = _check_map("optimizer", optimizer_map, local_dir, where)
    for name, entry in state.items():
        param, _, field = name.rpartition(".")
        if param not in shapes or field not in OPTIMIZER_FIELDS:
            raise MoerlError(f"{where}: optimizer state {name} names no parameter of the model")
        if field != "step" and entry.shape != shapes[param]:
            raise MoerlError(
                f"{where}: optimizer state {name} has shape {list(entry.shape)}, the weight {list(shapes[param])}"
            )
        if entry.dtype != "F32":
            raise MoerlError(f"{where}: optimizer state {name} is {entry.dtype}, not F32; rerun update with --force")
    if dtype != torch.float32:  # the next update resumes from the fp32 masters, not from the rounded weights
        missing = sorted(name for name in shapes if f"{name}.{MASTER_FIELD}" not in state)
        if missing:
            raise MoerlError(
                f"{where}: the optimizer state lacks the fp32 masters of {len(missing)} {dtype_name(dtype)} "
                f"weights (e.g. {missing[0]}.{MASTER_FIELD}); rerun update with --force"
            )
    return index, *publication.candidate_files(index)


def run_dtype(run: Store, version: int) -> torch.dtype:
    """The dtype published version `version` declares in its config.json: the run's (v000000's)."""
    config = json.loads(checkpoint.read_file(run, version, CONFIG_NAME))  # validated when it was published
    return declared_dtype(config, run.url(f"{version_prefix(version)}/{CONFIG_NAME}")) or torch.float32


def keep_parent_config(run: Store, iteration: int, candidate_dir: Path, where: str) -> None:
    """Put the parent version's config.json in place of the candidate's, which must describe the same model.

    The update regenerates config.json from the model (MoeConfig.to_hf_dict: pad_token_id, rope_parameters
    and its own field set added, the user's other fields dropped); published, that would make every version
    after v000000 carry another config.json than the one the user gave. So each version publishes its
    parent's bytes, and by induction v000000's: the user's config as import-sft stored it (plus the dtype it
    declares). Readers that start from one version and follow the run in place (SGLang never re-reads
    config.json on update_weights_from_disk) then see one config throughout. The weights were checked first
    (verify_candidate) against the candidate's own config, in the run's dtype, which is the dtype the parent's
    config declares: what is published is consistent with what it says."""
    parent = checkpoint.read_file(run, iteration - 1, CONFIG_NAME)
    parent_source = run.url(f"{version_prefix(iteration - 1)}/{CONFIG_NAME}")
    try:
        parent_config = json.loads(parent)
    except ValueError as err:
        raise MoerlError(f"{parent_source}: not valid JSON ({err}); the published parent is damaged") from err
    made = model_architecture(read_config_json(candidate_dir), f"{where}/{CONFIG_NAME}")
    if made != model_architecture(parent_config, parent_source):
        raise MoerlError(
            f"{where}/{CONFIG_NAME}: describes another model than {version_name(iteration - 1)} (every version of "
            "a run is the same model); rerun update with --force"
        )
    (candidate_dir / CONFIG_NAME).write_bytes(parent)


def assemble_hf_dir(
    candidate_dir: Path, index: dict[str, Any], model_files: list[str], optimizer_files: list[str], out_dir: Path
) -> None:
    """Move the candidate's files into a Hugging Face checkpoint layout in out_dir."""
    skip = {CANDIDATE_INDEX, MARKER, *model_files, *optimizer_files}
    for path in sorted(candidate_dir.iterdir()):
        if path.is_file() and path.name not in skip:
            path.rename(out_dir / path.name)
    if len(model_files) == 1:
        (candidate_dir / model_files[0]).rename(out_dir / SAFE_WEIGHTS_NAME)
        return
    tensors = []
    for old, new in candidate.published_weight_names(model_files).items():
        for entry in _headers(candidate_dir / old).values():
            numel = math.prod(entry.shape)
            tensors.append((numel, numel * SAFETENSORS_DTYPE_BYTES[entry.dtype]))
        (candidate_dir / old).rename(out_dir / new)
    (out_dir / SAFE_WEIGHTS_INDEX_NAME).write_text(publication.hf_index_text(index["weight_map"], model_files, tensors))


def publish_delta(run: Store, iteration: int, hf_dir: Path, marker: dict[str, Any], model_files: list[str]) -> str:
    """v(iteration)'s delta, before its MANIFEST.json (module docstring, 3.); returns the line for the log. The
    files about to be published are described without hashing the weights again: the candidate's, renamed,
    checked against the marker when they were downloaded."""
    small = [p for p in hf_dir.iterdir() if p.is_file() and not weight_delta.is_weight_file(p.name)]
    copies = {p.name: p.read_bytes() for p in small}
    files = publication.published_files(marker, model_files, copies)
    try:
        existing = weight_delta.read_index(run, iteration)
    except weight_delta.DeltaUnusable as err:
        print(f"warning: {err}; writing the delta of {version_name(iteration)} again")
        existing = None
    if existing is not None and not existing.describes(iteration, files):
        raise publication.indexed_differently(run, iteration)
    if existing is not None and weight_delta.blobs_stored(run, existing):
        return f"{weight_delta.describe(weight_delta.DeltaSummary.of(existing))} (indexed by the update)"
    blobs = weight_delta.file_deltas(marker.get("weight_deltas"))
    summary = weight_delta.adopt(run, iteration, files, blobs, copies)
    if summary is not None:
        return f"{weight_delta.describe(summary)} (written by the update's ranks)"
    # the update wrote none that describe these files: read both versions here
    return f"{weight_delta.describe(weight_delta.write_delta(run, iteration, hf_dir))} (written by publish)"


def clean_up(run: Store, iteration: int, keep_last: int) -> list[int]:
    """Retention, the optimizer state and deltas of versions no longer published, and the published candidate.

    A delta above `iteration` belongs to a publish still to come (it is written before its MANIFEST.json)."""
    doomed = checkpoint.apply_retention(run, keep_last)
    published = set(checkpoint.published_versions(run))
    stale = {key.split("/")[1] for key in run.list(f"{OPTIMIZER_PREFIX}/") if len(key.split("/")) == 3}
    for name in sorted(stale):
        if parse_version(name) not in published:
            run.delete_prefix(f"{OPTIMIZER_PREFIX}/{name}/")
    deltas = {key.split("/")[1] for key in run.list(f"{DELTAS_PREFIX}/") if len(key.split("/")) == 3}
    for name in sorted(deltas):
        version = parse_version(name)
        if version not in published and version <= iteration:
            run.delete(delta_index_key(version))  # first: a delta half-way through deletion reads as unfinished
            run.delete_prefix(delta_prefix(version))
    run.delete_prefix(candidate_prefix(iteration))
    return doomed


def publish(run_uri: str, iteration: int) -> checkpoint.Manifest:
    """Publish iteration `iteration`'s candidate as v(iteration); see the module docstring."""
    if iteration < 1:
        raise MoerlError(f"--iteration {iteration}: iterations start at 1 (v000000 is published by import-sft)")
    run = Store.open(run_uri)
    cfg = load_run_config(run)
    keep_last = cfg.checkpoint.keep_last
    existing = checkpoint.read_manifest(run, iteration)
    if existing is not None:
        checkpoint.move_latest(run, iteration)
        clean_up(run, iteration, keep_last)
        print(f"{version_name(iteration)} was already published; LATEST and retention checked")
        return existing

    where = run.url(candidate_prefix(iteration))
    # the trainer may still be storing the optimizer shards (or its replacement replaying them): where the run's
    # trainer defers them, and wherever the weights were indexed before (whatever the config says now)
    if candidate.defers_optimizer(cfg) or run.exists(delta_index_key(iteration)):
        marker = candidate.wait_for_marker(run, iteration, cfg.trainer.publish_wait_s)
    else:
        marker = candidate.read_marker(run, iteration)
    if marker is None:
        raise MoerlError(
            f"{where}: no complete candidate ({MARKER} missing); the update of iteration {iteration} did not "
            f"finish — run it first (torchrun -m steps.update --run {run.uri} --iteration {iteration})"
        )
    if marker.get("iteration") != iteration or marker.get("parent") != iteration - 1:
        raise MoerlError(
            f"{where}/{MARKER}: describes iteration {marker.get('iteration')} with parent "
            f"{marker.get('parent')}, expected iteration {iteration} with parent {iteration - 1}; rerun update"
        )
    checkpoint.require_manifest(run, iteration - 1)
    progress.report(0, 3)
    with tempfile.TemporaryDirectory(prefix="moerl-publish-") as tmp:
        candidate_dir, hf_dir = Path(tmp) / "candidate", Path(tmp) / "checkpoint"
        candidate_dir.mkdir()
        hf_dir.mkdir()
        try:
            candidate.download(run, iteration, marker, candidate_dir)
            if not (candidate_dir / CONFIG_NAME).is_file():
                raise MoerlError(f"{where}: the candidate has no {CONFIG_NAME}; rerun update with --force")
            index, model_files, optimizer_files = verify_candidate(candidate_dir, where, run_dtype(run, iteration - 1))
            keep_parent_config(run, iteration, candidate_dir, where)
            assemble_hf_dir(candidate_dir, index, model_files, optimizer_files, hf_dir)
            validate_checkpoint_dir(hf_dir)
        except MoerlError as err:  # "rerun update with --force" is refused for a version indexed before publish
            raise publication.indexed_candidate_refused(run, cfg, iteration, err) from err
        progress.report(1, 3)
        if weight_delta.wanted(cfg):  # before MANIFEST.json: a delta is complete or absent
            print(publish_delta(run, iteration, hf_dir, marker, model_files))
        store_optimizer_state(run, iteration, candidate_dir, index["optimizer_map"])
        progress.report(2, 3)
        manifest = checkpoint.publish_dir(run, hf_dir, iteration, parent=iteration - 1, iteration=iteration)
    doomed = clean_up(run, iteration, keep_last)
    progress.report(3, 3)
    print(
        f"published {version_name(iteration)} (parent {version_name(iteration - 1)}, "
        f"{len(manifest.files)} files) to {run.url(version_prefix(iteration))}"
        + (f"; retention deleted {', '.join(version_name(v) for v in doomed)}" if doomed else "")
    )
    return manifest


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.publish", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI (file://, plain path or s3://bucket/prefix)")
    parser.add_argument("--iteration", required=True, type=int, help="the iteration whose candidate to publish")
    args = parser.parse_args()
    publish(args.run, args.iteration)
    return 0


if __name__ == "__main__":
    run_cli(main)
