"""The candidate format: what update writes to <run>/candidates/iter-I/ and publish verifies and publishes.

    model-rank0000r-of-0000n.safetensors       the weights EP rank r holds (rank 0 also the replicated ones),
                                               in the run's checkpoint dtype
    optimizer-rank0000r-of-0000n.safetensors   AdamW state of the same parameters (+ their fp32 masters)
    config.json, generation_config.json, tokenizer files
    candidate.index.json                       {"metadata", "weight_map", "optimizer_map"}: tensor name -> file
    WEIGHTS.json                               written once the weights are: iteration, parent, every file but
                                               the optimizer shards with size + sha256, and the weight delta
                                               blobs the ranks wrote (weight_deltas)
    optimizer-receipts/<optimizer shard>.json  {size, sha256} of one optimizer shard, by its writer (a trainer
                                               that stays up writes them after answering: see below)
    CANDIDATE.json                             written LAST: WEIGHTS.json's content with the optimizer shards
                                               added to its files

A candidate without CANDIDATE.json is unfinished: publish waits for it while WEIGHTS.json says the weights are
complete (a trainer that stays up writes the optimizer shards after it answered the update, off the path to
the next rollout and the next update: steps/training/optimizer_write.py), and refuses it otherwise. An update
that finds no WEIGHTS.json deletes what is there and trains again; one that finds WEIGHTS.json alone trains
again too, unless the version was indexed (rollout servers may have generated with it): then it trains the
same inputs again, checks that the weights come out bit for bit as WEIGHTS.json records them, and writes only
the optimizer shards and CANDIDATE.json (steps/training/update.py, the replay).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steps.errors import MoerlError
from steps.run import weight_delta
from steps.run.checkpoint import file_digest
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store

if TYPE_CHECKING:
    from steps.run.config import RunConfig

MARKER = "CANDIDATE.json"
WEIGHTS_MARKER = "WEIGHTS.json"
CANDIDATE_INDEX = "candidate.index.json"
OPTIMIZER_RECEIPTS = "optimizer-receipts"


def model_shard_name(ep_rank: int, ep_size: int) -> str:
    return f"model-rank{ep_rank:05d}-of-{ep_size:05d}.safetensors"


def published_weight_names(model_files: list[str]) -> dict[str, str]:
    """The Hugging Face name each candidate weight file is published under (steps/publish.py): one file is
    model.safetensors, several are model-0000k-of-0000n.safetensors in their names' order (EP rank order)."""
    if len(model_files) == 1:
        return {model_files[0]: "model.safetensors"}
    ordered = sorted(model_files)
    return {old: f"model-{k:05d}-of-{len(ordered):05d}.safetensors" for k, old in enumerate(ordered, 1)}


def published_weight_name(ep_rank: int, ep_size: int) -> str:
    """The published name of EP rank `ep_rank`'s weight file (what its delta blob is named after)."""
    files = [model_shard_name(r, ep_size) for r in range(ep_size)]
    return published_weight_names(files)[model_shard_name(ep_rank, ep_size)]


def optimizer_shard_name(ep_rank: int, ep_size: int) -> str:
    return f"optimizer-rank{ep_rank:05d}-of-{ep_size:05d}.safetensors"


# What EP rank r writes: its weight file (with that file's delta blob, made from the local file) and its
# optimizer file. Every dp replica of r holds the same bits, so any of them can write either.
WEIGHTS, OPTIMIZER = "weights", "optimizer"
SHARD_KINDS = (WEIGHTS, OPTIMIZER)


def shard_writers(sizes: list[dict[str, float]], dp_size: int, ranks_per_node: int) -> dict[tuple[int, str], int]:
    """Which trainer rank writes each file of the candidate's shards, {(EP rank, kind): rank}, so that no node
    writes much more than the others: sizes[r][kind] is EP rank r's file of that kind (bytes, or any unit);
    rank d * ep_size + r is EP rank r's replica d, on node rank // ranks_per_node (torchrun's numbering).
    The largest file first, each to the replica whose node has the fewest bytes so far (then the replica
    writing fewest files, then the lowest dp rank): deterministic, so every rank computes the same plan.
    With one dp replica, the first dp row writes everything, as it did before. The files and their contents
    do not depend on who writes them. `moerl simulate` models the write with the same plan
    (pipelines/simulate/sizing.py, candidate_write_s)."""
    ep_size = len(sizes)
    node_load: dict[int, float] = {}
    rank_files: dict[int, int] = {}
    writers: dict[tuple[int, str], int] = {}
    jobs = sorted(((-float(sizes[r][k]), r, i, k) for r in range(ep_size) for i, k in enumerate(SHARD_KINDS)))
    for neg_size, r, _, kind in jobs:
        rank = min(
            (d * ep_size + r for d in range(dp_size)),
            key=lambda q: (node_load.get(q // ranks_per_node, 0.0), rank_files.get(q, 0), q),
        )
        node_load[rank // ranks_per_node] = node_load.get(rank // ranks_per_node, 0.0) - neg_size
        rank_files[rank] = rank_files.get(rank, 0) + 1
        writers[(r, kind)] = rank
    return writers


def node_write_loads(
    sizes: list[dict[str, float]], writers: dict[tuple[int, str], int], ranks_per_node: int
) -> dict[int, float]:
    """What each node writes under `writers` (shard_writers): node -> the sum of its ranks' files."""
    loads: dict[int, float] = {}
    for (r, kind), rank in writers.items():
        node = rank // ranks_per_node
        loads[node] = loads.get(node, 0.0) + float(sizes[r][kind])
    return loads


def index_text(iteration: int, info: dict[str, Any], weight_map: dict[str, str], optimizer_map: dict[str, str]) -> str:
    """candidate.index.json: which file holds each weight and each optimizer state tensor."""
    index = {
        "metadata": {"iteration": iteration, "parent": iteration - 1, **info},
        "weight_map": dict(sorted(weight_map.items())),
        "optimizer_map": dict(sorted(optimizer_map.items())),
    }
    return json.dumps(index, indent=2) + "\n"


def write_weights_marker(
    run: Store,
    iteration: int,
    info: dict[str, Any],
    files: dict[str, dict[str, Any]],
    weight_deltas: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """WEIGHTS.json: every file of the candidate but its optimizer shards is there (`files`, with size and
    sha256). `weight_deltas`: the delta blobs the update wrote, by published file name
    (steps/run/weight_delta.py)."""
    marker = {
        "iteration": iteration,
        "parent": iteration - 1,
        **info,
        "files": dict(sorted(files.items())),
        **({"weight_deltas": dict(sorted(weight_deltas.items()))} if weight_deltas else {}),
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    run.put_json(_weights_key(iteration), marker)
    return marker


def write_marker(
    run: Store, iteration: int, weights_marker: dict[str, Any], optimizer_files: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """CANDIDATE.json, the last object of a candidate: WEIGHTS.json's content (`weights_marker`) with the
    optimizer shards (`optimizer_files`: name -> size, sha256) added; its presence says every file it lists
    is there."""
    marker = dict(weights_marker)
    marker["files"] = dict(sorted({**weights_marker["files"], **optimizer_files}.items()))
    marker["created_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    run.put_json(f"{candidate_prefix(iteration)}/{MARKER}", marker)
    return marker


def read_marker(run: Store, iteration: int) -> dict[str, Any] | None:
    """The complete candidate's CANDIDATE.json, or None while there is none (absent or unfinished)."""
    key = f"{candidate_prefix(iteration)}/{MARKER}"
    return run.get_json(key) if run.exists(key) else None


def _weights_key(iteration: int) -> str:
    return f"{candidate_prefix(iteration)}/{WEIGHTS_MARKER}"


def read_weights_marker(run: Store, iteration: int) -> dict[str, Any] | None:
    """What describes the candidate's weights: CANDIDATE.json when it is complete, else WEIGHTS.json while its
    optimizer shards are still to come, else None (no complete weights)."""
    marker = read_marker(run, iteration)
    if marker is not None:
        return marker
    key = _weights_key(iteration)
    return run.get_json(key) if run.exists(key) else None


def awaits_optimizer(run: Store, iteration: int) -> bool:
    """Whether candidate `iteration` has its weights (WEIGHTS.json) and not yet its optimizer shards (no
    CANDIDATE.json)."""
    return run.exists(_weights_key(iteration)) and read_marker(run, iteration) is None


def defers_optimizer(cfg: RunConfig) -> bool:
    """Whether the run's trainer stores the optimizer shards after it answered: one that stays up and holds
    versions (rollout servers and deltas: the next update waits for it, not for publish), unless
    trainer.optimizer_after_answer is off."""
    return cfg.trainer.server and weight_delta.wanted(cfg) and cfg.trainer.optimizer_after_answer


def optimizer_after_answer(cfg: RunConfig, iteration: int) -> bool:
    """What the client of update `iteration` asks: after the answer, except for the segment's last update (the
    Workflow's end stops the trainer)."""
    return defers_optimizer(cfg) and cfg.segment_last(iteration) != iteration


MARKER_POLL_S = 2.0  # how often a publish that waits for the optimizer shards looks for CANDIDATE.json


def wait_for_marker(
    run: Store, iteration: int, wait_s: float, log: Callable[[str], None] = print, poll_s: float = MARKER_POLL_S
) -> dict[str, Any] | None:
    """CANDIDATE.json of candidate `iteration`: at once when it is there; None when not even WEIGHTS.json is
    (the update did not finish); else, the weights complete and the optimizer shards still being written by a
    trainer that stays up, waited for at most `wait_s` (trainer.publish_wait_s), then refused naming the way out."""
    if not awaits_optimizer(run, iteration):
        return read_marker(run, iteration)
    log(f"candidate of iteration {iteration}: weights complete, waiting for its optimizer shards ({MARKER})")
    started = time.monotonic()
    while (marker := read_marker(run, iteration)) is None:
        if time.monotonic() - started >= wait_s:
            raise MoerlError(
                f"{run.url(candidate_prefix(iteration))}: the weights are complete ({WEIGHTS_MARKER}) but the "
                f"optimizer shards did not come within {wait_s:.0f} s (trainer.publish_wait_s): the trainer that "
                f"answered update {iteration} was lost, or its write failed, before it stored them. A trainer that "
                f"stays up trains iteration {iteration} again when it starts and when the next update needs it (or "
                f"run python -m steps.update --run {run.uri} --iteration {iteration}); then rerun this publish"
            )
        time.sleep(poll_s)
    return marker


def receipts_prefix(iteration: int) -> str:
    return f"{candidate_prefix(iteration)}/{OPTIMIZER_RECEIPTS}/"


def receipt_key(iteration: int, file_name: str) -> str:
    """Where the writer of optimizer shard `file_name` records its size and sha256 once it is stored."""
    return f"{receipts_prefix(iteration)}{file_name}.json"


def download(run: Store, iteration: int, marker: dict[str, Any], local_dir: Path) -> None:
    """Every file the marker lists, checked against its recorded size and sha256."""
    prefix = candidate_prefix(iteration)
    for name, meta in marker["files"].items():
        key = f"{prefix}/{name}"
        if not run.exists(key):
            raise MoerlError(
                f"{run.url(key)}: listed in {MARKER} but missing; the candidate is incomplete — rerun update "
                f"for iteration {iteration} with --force"
            )
        target = local_dir / name
        run.get_file(key, target)
        if file_digest(target) != (meta["size"], meta["sha256"]):
            raise MoerlError(
                f"{run.url(key)}: size or sha256 differs from {MARKER}; the candidate is corrupted — rerun "
                f"update for iteration {iteration} with --force"
            )


def read_index(local_dir: Path, where: str) -> dict[str, Any]:
    """The downloaded candidate's candidate.index.json."""
    index_path = local_dir / CANDIDATE_INDEX
    if not index_path.is_file():
        raise MoerlError(f"{where}: no {CANDIDATE_INDEX} in the candidate; rerun update with --force")
    return json.loads(index_path.read_text())
