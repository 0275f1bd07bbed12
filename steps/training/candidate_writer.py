"""Writing candidate I, the update's output (its format: steps/run/candidate.py): which rank writes each file of
the candidate's shards (writer_plan: spread over each EP rank's dp replicas and over the nodes, from the shard byte
estimates), the weight shards with their deltas (write_weight_shard), then on rank 0 the config, generation
config, tokenizer files, index and metrics and WEIGHTS.json (write_weights_metadata), then the optimizer shards
(optimizer_shard, write_optimizer_shard) and CANDIDATE.json (steps/run/candidate.py write_marker). The iteration that
calls them: steps/training/update.py.

EP rank r's weight file holds its experts' tensors (and, on EP rank 0, every replicated one), under the
checkpoint's names. A family whose checkpoint fuses a MoE layer's experts into one tensor (gpt-oss: the adapter's
fused_experts, steps/models/family.py FusedExperts) cannot write it from one EP rank's experts: each fused tensor
is written by one EP rank (the MoE layers dealt round-robin over the EP ranks: _fused_owner), which gathers its
slices from the EP ranks of its dp replica, one tensor at a time, into global expert order (any placement). Those
gathers are collectives of the EP group, so every EP rank of one dp row writes its weight file (writer_plan), and
both callers of _stored (write_weight_shard, stored_bits) run on all of them. Families with one tensor per expert write
each EP rank's experts on their own, without any collective.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from steps.expert_parallel.mesh import Mesh
from steps.models.causal_lm import MoeCausalLM
from steps.models.family import FusedExperts
from steps.models.hf_checkpoint import CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME
from steps.models.moe import stored_dtype
from steps.models.placement import is_expert_param
from steps.models.registry import family_of
from steps.run import candidate, weight_delta
from steps.run.checkpoint import file_digest
from steps.run.keys import candidate_prefix, update_metrics_key
from steps.store.object_store import Store
from steps.training.optim import AnyOptimizer
from steps.training.optimizer_state import optimizer_state_tensors
from steps.training.sharding import any_sharded, full_state_dict


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _written(mesh: Mesh, name: str) -> bool:
    """Whether this rank's EP rank's files hold tensor `name` (not a fused one: _fused_owner): its experts, and a
    replicated tensor only with EP rank 0's experts. Which of the EP rank's dp replicas writes each file:
    writer_plan."""
    return mesh.ep_rank == 0 or is_expert_param(name)


def _fused(model: MoeCausalLM) -> list[FusedExperts]:
    """The checkpoint tensors of `model`'s family that fuse a layer's experts ([]: one tensor per expert)."""
    return family_of(model).state_dict_adapter.fused_experts(model.config)


def _fused_owner(mesh: Mesh, fused: FusedExperts) -> int:
    """The EP rank whose weight file holds fused tensor `fused`: the MoE layers dealt round-robin over the EP
    ranks, so that each writes about as many bytes."""
    return fused.moe_layer % mesh.ep_size


def _as_stored(
    name: str, t: torch.Tensor, dtype: torch.dtype, own: tuple[str, ...], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Tensor `name` as stored beside weights of `dtype` (own: the family's float32 tensors)."""
    return t.detach().to(device, stored_dtype(name, dtype, own)).contiguous()


def _gather_fused(
    model: MoeCausalLM, state: dict[str, torch.Tensor], mesh: Mesh, fused: FusedExperts, dtype: torch.dtype
) -> torch.Tensor | None:
    """Fused tensor `fused` as stored (on the CPU) on its owner EP rank (_fused_owner), None on the others: every
    EP rank of this dp replica sends the slices of the experts it holds (model.placement's), stacked and rounded
    to the stored dtype, to the owner, which puts each at its global expert index. A collective of the EP group."""
    placement = model.placement
    if placement is None and mesh.ep_size > 1:
        raise ValueError(f"{fused.name}: an EP rank's model without its expert placement")

    def held(ep_rank: int) -> tuple[int, ...]:
        return placement.held(fused.moe_layer, ep_rank) if placement is not None else tuple(range(len(fused.experts)))

    mine = torch.stack([state[fused.experts[e]].detach() for e in held(mesh.ep_rank)], dim=fused.dim)
    mine = _as_stored(fused.name, mine, dtype, family_of(model).float32_tensors, mine.device)
    owner = _fused_owner(mesh, fused)
    parts: list[torch.Tensor] | None = [mine]
    if mesh.ep_size > 1:
        parts = [torch.empty_like(mine) for _ in range(mesh.ep_size)] if mesh.ep_rank == owner else None
        dist.gather(mine, parts, dst=mesh.ep_ranks()[owner], group=mesh.ep_group)
    if parts is None:
        return None
    out = torch.empty(fused.shape, dtype=mine.dtype)
    for ep_rank, part in enumerate(parts):
        part = part.cpu()
        for i, expert in enumerate(held(ep_rank)):
            out.select(fused.dim, expert).copy_(part.select(fused.dim, i))
    return out


def _stored(model: MoeCausalLM, mesh: Mesh, dtype: torch.dtype, keep: bool = True) -> dict[str, torch.Tensor]:
    """The weights of this rank's EP rank, as they are stored: under the checkpoint's tensor names (the family's
    state-dict adapter), rounded to the run's checkpoint dtype, on the CPU. With fused expert tensors, the ones
    this EP rank writes, gathered (_gather_fused: every EP rank of the dp replica must call this). With
    trainer.fsdp every rank must call it (the sharded tensors are gathered whole: sharding.full_state_dict);
    keep=False: a rank that writes no weight file takes part and keeps nothing."""
    adapter = family_of(model).state_dict_adapter
    fused = _fused(model)
    state = full_state_dict(model, keep) if any_sharded(model) else model.state_dict()
    if not keep:
        return {}
    slices = {name for f in fused for name in f.experts}
    named = adapter.to_hf({n: t for n, t in state.items() if n not in slices} if fused else state)
    own = family_of(model).float32_tensors
    stored = {n: _as_stored(n, t, dtype, own) for n, t in named.items() if _written(mesh, n)}
    for f in fused:  # one tensor at a time, in the same order on every EP rank
        tensor = _gather_fused(model, state, mesh, f, dtype)
        if tensor is not None:
            stored[f.name] = tensor
    return stored


def _shard_bytes(model: MoeCausalLM, mesh: Mesh, dtype: torch.dtype) -> dict[str, int]:
    """About how many bytes this rank's EP rank's weight and optimizer files hold, from the shapes alone (the
    same before and after training): the weights in `dtype` (the fused expert tensors it writes whole); per
    parameter exp_avg, exp_avg_sq, step and, when `dtype` is narrower than the parameter, its master
    (optimizer_state_tensors, by the model's names: one expert's slices each)."""
    fused = _fused(model)
    slices = {name for f in fused for name in f.experts}
    weights = sum(
        t.numel() * dtype.itemsize for n, t in model.state_dict().items() if n not in slices and _written(mesh, n)
    )
    weights += sum(math.prod(f.shape) * dtype.itemsize for f in fused if _fused_owner(mesh, f) == mesh.ep_rank)
    optimizer = sum(
        p.numel() * p.element_size() * (2 + (dtype != p.dtype)) + 4
        for n, p in model.named_parameters()
        if _written(mesh, n)
    )
    return {candidate.WEIGHTS: weights, candidate.OPTIMIZER: optimizer}


def writer_plan(model: MoeCausalLM, mesh: Mesh, dtype: torch.dtype) -> dict[tuple[int, str], int]:
    """Which rank writes each file of the candidate's shards (candidate.shard_writers): spread over each EP
    rank's dp replicas, which hold the same bits after the all-reduce, and over the nodes, so that no node
    writes the whole candidate. Every rank's sizes and node size (torchrun's LOCAL_WORLD_SIZE) are gathered
    (a few integers), so that every rank computes the same plan from the same figures: rank 0's node size,
    the first dp row's sizes."""
    sizes = _shard_bytes(model, mesh, dtype)
    row = [sizes[candidate.WEIGHTS], sizes[candidate.OPTIMIZER], int(os.environ.get("LOCAL_WORLD_SIZE", "0"))]
    rows = [row]
    if mesh.world_group is not None:
        mine = torch.tensor(row, dtype=torch.int64, device=mesh.device)
        gathered = [torch.zeros_like(mine) for _ in range(mesh.world_size)]
        dist.all_gather(gathered, mine)
        rows = [t.cpu().tolist() for t in gathered]
    per_node = rows[0][2] if rows[0][2] > 0 else mesh.world_size
    ep_sizes = [{candidate.WEIGHTS: w, candidate.OPTIMIZER: o} for w, o, _ in rows[: mesh.ep_size]]
    writers = candidate.shard_writers(ep_sizes, mesh.dp_size, per_node)
    if _fused(model):  # the weight files of every EP rank from one dp row (the gathers of _stored): EP rank 0's
        row = writers[(0, candidate.WEIGHTS)] // mesh.ep_size
        writers.update({(r, candidate.WEIGHTS): row * mesh.ep_size + r for r in range(mesh.ep_size)})
    return writers


def _check_fused_writers(model: MoeCausalLM, mesh: Mesh, writers: dict[tuple[int, str], int]) -> None:
    """With fused expert tensors, every EP rank's weight file must be written from the same dp row (writer_plan):
    the same check on every rank, before any collective."""
    rows = {writers[(r, candidate.WEIGHTS)] // mesh.ep_size for r in range(mesh.ep_size)}
    if _fused(model) and len(rows) > 1:
        raise ValueError(
            f"{family_of(model).name} fuses each layer's experts into one checkpoint tensor: every EP rank's "
            f"weight file must be written from one dp row (writer_plan), not from rows {sorted(rows)}"
        )


def _first_row(mesh: Mesh) -> dict[tuple[int, str], int]:
    """The plan before writer_plan: the first dp row writes every file."""
    return {(mesh.ep_rank, kind): mesh.ep_rank for kind in candidate.SHARD_KINDS}


def writes(mesh: Mesh, writers: dict[tuple[int, str], int], kind: str) -> bool:
    """Whether this rank writes its EP rank's file of `kind` under `writers`."""
    return writers[(mesh.ep_rank, kind)] == mesh.rank


def stored_bits(
    model: MoeCausalLM, mesh: Mesh, dtype: torch.dtype, keep: bool = True
) -> weight_delta.StoredTensors | None:
    """The bits this rank's weights are stored as now: taken before training, they are v(I-1)'s published
    bits (the model then holds v(I-1)'s weights, or their fp32 masters, which v(I-1) was rounded from), the
    parent of this rank's delta. With fused expert tensors, a collective of the EP group (_stored): called by the
    writers of the weight files, who are then one dp row's EP ranks (writer_plan). With trainer.fsdp every rank
    calls it; keep=False (a rank that writes no weight file) takes part in the gathers and returns None."""
    stored = _stored(model, mesh, dtype, keep)
    if not keep:
        return None
    return weight_delta.StoredTensors(
        {
            name: (SAFETENSORS_DTYPES[t.dtype], tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
            for name, t in stored.items()
            if t.dtype in SAFETENSORS_DTYPES
        }
    )


def write_weight_shard(
    run: Store,
    iteration: int,
    mesh: Mesh,
    model: MoeCausalLM,
    workdir: Path,
    dtype: torch.dtype = torch.float32,
    delta_parent: weight_delta.StoredTensors | None = None,
    writers: dict[tuple[int, str], int] | None = None,
    upload: bool = True,
) -> dict[str, Any]:
    """Upload this rank's EP rank's weight file when `writers` (writer_plan; default: the first dp row writes
    them all) gives it to this rank: the weights rounded to `dtype`, the run's checkpoint dtype. With
    `delta_parent` (stored_bits before training) its delta blob against it too (steps/run/weight_delta.py).
    The file is the same whichever replica writes it. upload=False (a replay: the candidate's weights are
    stored already) writes and hashes it locally and stores nothing. Returns {"files": {name: {size, sha256}},
    "weights": {tensor: file}, "deltas": {published file name: FileDelta as JSON}} of what this rank wrote
    (nothing when it wrote nothing)."""
    out: dict[str, Any] = {"files": {}, "weights": {}, "deltas": {}}
    writers = writers or _first_row(mesh)
    _check_fused_writers(model, mesh, writers)
    if not writes(mesh, writers, candidate.WEIGHTS):
        if any_sharded(model):  # every rank takes part in the gathers
            _stored(model, mesh, dtype, keep=False)
        return out
    file_name = candidate.model_shard_name(mesh.ep_rank, mesh.ep_size)
    tensors = _stored(model, mesh, dtype)
    local = workdir / file_name
    _save(tensors, local)
    if upload:
        sha = run.put_file(f"{candidate_prefix(iteration)}/{file_name}", local)
    else:
        sha = file_digest(local)[1]
    out["files"][file_name] = {"size": local.stat().st_size, "sha256": sha}
    out["weights"] = dict.fromkeys(tensors, file_name)
    del tensors
    if upload and delta_parent is not None:
        name = candidate.published_weight_name(mesh.ep_rank, mesh.ep_size)
        out["deltas"][name] = asdict(weight_delta.write_file_delta(run, iteration, name, local, delta_parent, sha))
    local.unlink()
    return out


def optimizer_shard(
    model: MoeCausalLM,
    optimizer: AnyOptimizer,
    mesh: Mesh,
    writers: dict[tuple[int, str], int] | None = None,
    dtype: torch.dtype = torch.float32,
    copy: bool = False,
) -> tuple[str, dict[str, torch.Tensor]] | None:
    """(file name, tensors) of the optimizer shard this rank writes under `writers` (its EP rank's AdamW state,
    and the fp32 masters when `dtype` is narrower than the parameters), None when it writes none. With
    trainer.fsdp a collective that every rank calls. copy: the tensors share no memory with the model or the
    optimizer (they are written while a trainer that stays up trains on: steps/training/optimizer_write.py)."""
    writers = writers or _first_row(mesh)
    if not writes(mesh, writers, candidate.OPTIMIZER):
        if any_sharded(model):
            optimizer_state_tensors(model, optimizer, dtype)
        return None
    state = optimizer_state_tensors(model, optimizer, dtype)
    tensors = {n: t for n, t in state.items() if _written(mesh, n.rsplit(".", 1)[0])}
    del state
    if copy:  # a GPU's tensors were copied to the CPU already; a CPU's are the live ones, and so is AdamW's step
        on_cpu = next(model.parameters()).device.type == "cpu"
        tensors = {n: t.clone() if on_cpu or n.endswith(".step") else t for n, t in tensors.items()}
    return candidate.optimizer_shard_name(mesh.ep_rank, mesh.ep_size), tensors


def write_optimizer_shard(
    run: Store, iteration: int, shard: tuple[str, dict[str, torch.Tensor]] | None, workdir: Path
) -> dict[str, dict[str, Any]]:
    """Store optimizer shard `shard` (optimizer_shard's) in candidate `iteration`; its {name: {size, sha256}}
    ({} for None)."""
    if shard is None:
        return {}
    file_name, tensors = shard
    local = workdir / file_name
    _save(tensors, local)
    try:
        sha = run.put_file(f"{candidate_prefix(iteration)}/{file_name}", local)
        return {file_name: {"size": local.stat().st_size, "sha256": sha}}
    finally:
        local.unlink()


def write_weights_metadata(
    run: Store,
    iteration: int,
    parent_file: Callable[[str], bytes],
    model: MoeCausalLM,
    shards: list[dict[str, Any]],
    info: dict[str, Any],
    metrics: dict[str, Any],
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Rank 0: config (saying the weights' `dtype`), tokenizer, the index (every rank's weight and optimizer
    maps in `shards`), the metrics, then WEIGHTS.json: the weights of the candidate are complete.
    parent_file(name): the bytes of the parent version's file `name` (as its manifest has them)."""
    prefix = candidate_prefix(iteration)
    files: dict[str, dict[str, Any]] = {}
    weight_map: dict[str, str] = {}
    optimizer_map: dict[str, str] = {}
    deltas: dict[str, dict[str, Any]] = {}
    for shard in shards:
        files.update(shard["files"])
        weight_map.update(shard["weights"])
        optimizer_map.update(shard["optimizer"])
        deltas.update(shard.get("deltas") or {})

    def put(name: str, data: bytes) -> None:
        files[name] = {"size": len(data), "sha256": run.put_bytes(f"{prefix}/{name}", data)}

    def put_text(name: str, text: str) -> None:
        put(name, text.encode())

    put_text(CONFIG_NAME, json.dumps(model.config.to_hf_dict(dtype), indent=2) + "\n")
    # The parent's other files (generation config, tokenizer files, ...), as its manifest lists them: the
    # local cache may hold files of an earlier run that had the same URI.
    skip = {CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME}
    # published, or indexed (a trainer that stays up trains on before publish)
    for name in sorted(weight_delta.require_version_files(run, iteration - 1)):
        if "/" not in name and name not in skip and not name.endswith(".safetensors"):
            put(name, parent_file(name))
    if GENERATION_CONFIG_NAME not in files:
        put_text(GENERATION_CONFIG_NAME, json.dumps({"_from_model_config": True}, indent=2) + "\n")
    put_text(candidate.CANDIDATE_INDEX, candidate.index_text(iteration, info, weight_map, optimizer_map))
    run.put_json(update_metrics_key(iteration), {"update": metrics, "iteration": iteration})
    return candidate.write_weights_marker(run, iteration, info, files, deltas)


def optimizer_files(shards: list[dict[str, Any]]) -> list[str]:
    """The optimizer shard files the candidate has (every rank's optimizer map in `shards`)."""
    return sorted({name for shard in shards for name in shard["optimizer"].values()})


def weight_digests(shards: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(size, sha256) of the candidate's weight shards, from every rank's write_weight_shard answer."""
    files: dict[str, dict[str, Any]] = {}
    for shard in shards:
        files.update(shard["files"])
    names = {name for shard in shards for name in shard["weights"].values()}
    return sorted((int(files[n]["size"]), str(files[n]["sha256"])) for n in names)
