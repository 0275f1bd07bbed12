"""What a candidate publishes as, and the version's delta indexed before it is published.

    planned = publication(run, I, marker, blobs)   # v(I)'s files as steps/publish.py publishes them
    index_candidate(run, I, marker, log)    # DELTA.json of v(I) from the blobs the update's ranks wrote

v(I)'s files other than its weights are the candidate's small files (generation config, tokenizer files, as the
update carried them over from v(I-1)), with config.json replaced by the parent's bytes (every version publishes
v000000's config: steps/publish.py keep_parent_config) and, when there are several weight files, the shard index
transformers writes (hf_index_text). Publish assembles the same files from the downloaded candidate and refuses
to publish anything else once the update has indexed them.

index_candidate is the update's last act (rank 0, after CANDIDATE.json; again on a retry that finds the candidate
complete; a trainer that stays up indexes after WEIGHTS.json, before it answers and stores the optimizer shards:
steps/training/optimizer_write.py): the blobs are checked against the marker (WEIGHTS.json's content; each rebuilds
a weight file's size and sha256 as the marker records them, and is stored at its size), the tensors they rebuild
against the model's config (names, shapes, the run's dtype: what publish checks on the downloaded files), the small
files stored beside them, DELTA.json last. From then on a rollout server can bring its engine to v(I) from v(I-1)
and the delta while publish still writes the full checkpoint (steps/run/weight_delta.py, "A version is usable from
its delta before it is published"). """

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steps.errors import MoerlError
from steps.models.hf_checkpoint import (
    CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    TensorEntry,
    check_tensors,
    declared_dtype,
    weights_dtype,
)
from steps.models.registry import config_from_hf
from steps.run import candidate, checkpoint, weight_delta
from steps.run.config import RunConfig
from steps.run.keys import (
    candidate_prefix,
    delta_index_key,
    delta_prefix,
    experience_prefix,
    version_name,
    version_prefix,
)
from steps.store.object_store import Store


def hf_index_text(weight_map: dict[str, str], model_files: list[str], tensors: Iterable[tuple[int, int]]) -> str:
    """model.safetensors.index.json as transformers writes it: `weight_map` (tensor -> candidate file) under the
    published file names; `tensors`: each weight tensor's (number of elements, bytes)."""
    renamed = candidate.published_weight_names(model_files)
    total_parameters, total_size = 0, 0
    for numel, nbytes in tensors:
        total_parameters += numel
        total_size += nbytes
    hf_index = {
        "metadata": {"total_parameters": total_parameters, "total_size": total_size},
        "weight_map": {name: renamed[f] for name, f in sorted(weight_map.items())},
    }
    return json.dumps(hf_index, indent=2) + "\n"


def candidate_files(index: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The candidate's (model files, optimizer files), from its candidate.index.json."""
    return sorted(set(index.get("weight_map", {}).values())), sorted(set(index.get("optimizer_map", {}).values()))


def _candidate_bytes(run: Store, iteration: int, marker: dict[str, Any], name: str) -> bytes:
    key = f"{candidate_prefix(iteration)}/{name}"
    meta = marker["files"].get(name)
    data = run.get_bytes(key) if meta is not None and run.exists(key) else None
    if data is None or checkpoint.bytes_digest(data) != (meta["size"], meta["sha256"]):
        raise MoerlError(
            f"{run.url(key)}: missing, or its size or sha256 differs from the candidate's marker; the candidate is "
            f"damaged — rerun update for iteration {iteration} with --force"
        )
    return data


@dataclass(frozen=True)
class Publication:
    """What candidate I publishes as: every file of v(I) (the weight files under their published names with
    the marker's digests; the small files' digests) and the small files' bytes."""

    files: weight_delta.FileDigests
    small: dict[str, bytes]


def publication(
    run: Store, iteration: int, marker: dict[str, Any], blobs: dict[str, weight_delta.FileDelta]
) -> Publication:
    """v(iteration)'s files as publish publishes them (module docstring), read from the candidate in the store
    (its small files only) and from the published parent; `blobs` (the update's delta blobs, by published file
    name) give the tensors' sizes for the shard index."""
    index = json.loads(_candidate_bytes(run, iteration, marker, candidate.CANDIDATE_INDEX))
    model_files, optimizer_files = candidate_files(index)
    skip = {candidate.CANDIDATE_INDEX, *model_files, *optimizer_files}
    small = {
        name: _candidate_bytes(run, iteration, marker, name) for name in sorted(marker["files"]) if name not in skip
    }
    small[CONFIG_NAME] = weight_delta.read_version_file(run, iteration - 1, CONFIG_NAME)
    if len(model_files) > 1:
        tensors = [(math.prod(t.shape), t.size) for f in blobs.values() for t in f.tensors]
        small[SAFE_WEIGHTS_INDEX_NAME] = hf_index_text(index["weight_map"], model_files, tensors).encode()
    return Publication(published_files(marker, model_files, small), small)


def published_files(
    marker: dict[str, Any], model_files: list[str], small: dict[str, bytes]
) -> weight_delta.FileDigests:
    """Every file v(I) is published with: the candidate's weight files under their published names, with the
    digests the marker records (so nothing is hashed again), and the small files'."""
    files: weight_delta.FileDigests = {}
    for old, new in candidate.published_weight_names(model_files).items():
        files[new] = {"size": int(marker["files"][old]["size"]), "sha256": str(marker["files"][old]["sha256"])}
    files.update(weight_delta.copy_digests(small))
    return dict(sorted(files.items()))


def _check_tensors(run: Store, iteration: int, blobs: dict[str, weight_delta.FileDelta]) -> None:
    """The tensors the blobs rebuild, against the parent's config.json: what publish checks in the files
    (every tensor once with the config's shape, stored in the run's dtype)."""
    where = run.url(candidate_prefix(iteration))
    parent_config = json.loads(weight_delta.read_version_file(run, iteration - 1, CONFIG_NAME))
    parent_source = run.url(f"{version_prefix(iteration - 1)}/{CONFIG_NAME}")
    entries = {t.name: TensorEntry(Path(name), t.shape, t.dtype) for name, f in blobs.items() for t in f.tensors}
    check_tensors(config_from_hf(parent_config, source=parent_source), entries, where)
    run_dtype = declared_dtype(parent_config, parent_source) or torch.float32
    if weights_dtype(parent_config, entries, where) != run_dtype:
        raise MoerlError(
            f"{where}: the weights' delta blobs hold another dtype than the run's "
            f"({declared_dtype(parent_config, parent_source) or 'float32'}); rerun update with --force"
        )


def index_candidate(
    run: Store, iteration: int, marker: dict[str, Any], log: Callable[[str], None] = print
) -> weight_delta.DeltaSummary:
    """Index v(iteration)'s delta from the blobs the update wrote (module docstring); idempotent. Refuses a
    candidate whose blobs do not describe its weight files, and one other than the candidate v(iteration) was
    already indexed from (an indexed version is final)."""
    blobs = weight_delta.file_deltas(marker.get("weight_deltas"))
    if blobs is None:
        raise MoerlError(
            f"{run.url(candidate_prefix(iteration))}: its marker lists no delta blobs, which a run with "
            f"rollout servers and checkpoint.deltas reads; rerun update for iteration {iteration} with --force"
        )
    planned = publication(run, iteration, marker, blobs)
    try:
        existing = weight_delta.read_index(run, iteration)
    except weight_delta.DeltaUnusable as err:
        log(f"warning: {err}; indexing the delta of {version_name(iteration)} again")
        existing = None
    if existing is not None:
        if not existing.describes(iteration, planned.files):
            raise indexed_differently(run, iteration)
        if weight_delta.blobs_stored(run, existing):
            return weight_delta.DeltaSummary.of(existing)
    _check_tensors(run, iteration, blobs)
    summary = weight_delta.adopt(run, iteration, planned.files, blobs, planned.small)
    if summary is None:
        raise MoerlError(
            f"{run.url(candidate_prefix(iteration))}: the delta blobs the update wrote do not describe its weight "
            f"files (or are missing); rerun update for iteration {iteration} with --force"
        )
    return summary


def indexed_candidate_refused(run: Store, cfg: RunConfig, iteration: int, err: MoerlError) -> MoerlError:
    """Publish's refusal of candidate `iteration`, with the way out when the update indexed v(iteration) before
    (rollout servers may have generated with it, so the update refuses to train it again as it is)."""
    if not run.exists(delta_index_key(iteration)):
        return err
    sampled = iteration + 1 + cfg.staleness  # the iteration whose rollout samples from v(iteration)
    later = (
        f", and what was trained from it meanwhile ({run.url(candidate_prefix(iteration + 1))}, "
        f"{run.url(delta_prefix(iteration + 1))} and the experience sampled from that)"
        if cfg.trainer.server
        else ""
    )
    return MoerlError(
        f"{err}. (If that is the store's or the local disk's error, rerun publish.) {version_name(iteration)} was "
        f"indexed before publish ({run.url(delta_index_key(iteration))}) and rollout servers may have generated with "
        f"it, so the update refuses to train it again until {run.url(experience_prefix(sampled))}/ (sampled from "
        f"it), {run.url(delta_prefix(iteration))}{later} are deleted"
    )


def indexed_differently(run: Store, iteration: int) -> MoerlError:
    """The refusal for a candidate other than the one v(iteration) was indexed from."""
    return MoerlError(
        f"{run.url(delta_index_key(iteration))}: {version_name(iteration)} was indexed from another candidate, "
        f"and rollout servers may have generated with it (an indexed version is final); publish that candidate, or "
        f"delete the experience sampled from {version_name(iteration)} and {run.url(delta_index_key(iteration))} "
        "before training the iteration again"
    )
