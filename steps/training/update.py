"""The policy update of one iteration, shared by the update step (steps/update.py: one torchrun per
iteration) and the trainer that stays up (steps/trainer_server.py): read the iteration's inputs, bring each
rank's model and AdamW state to v(I-1) (from the store, or from what a trainer that stays up holds:
steps/training/held_state.py), train, and write the candidate (steps/training/candidate_writer.py).
steps/update.py's docstring describes the inputs, the outputs, the precision and the expert placement.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from steps import progress
from steps.errors import MoerlError
from steps.experience.tables import Sample, read_scored_experience
from steps.expert_parallel.dispatch import HeldDispatch, make_dispatch
from steps.expert_parallel.mesh import Mesh, all_reduce_sum, build_mesh, resolve_ep_size
from steps.expert_parallel.timing import CommTimer
from steps.models.experts import set_grouped_gemm
from steps.models.family import FamilyConfig
from steps.models.hf_checkpoint import checkpoint_dtype, load_config, load_pretrained, model_from_state
from steps.models.placement import ExpertPlacement, balanced_placement, moe_layer_indices
from steps.run import candidate, checkpoint, weight_delta
from steps.run.config import RunConfig, load_run_config
from steps.run.keys import (
    behaviour_version,
    candidate_prefix,
    delta_index_key,
    delta_prefix,
    scored_key,
    update_metrics_key,
    version_name,
)
from steps.store.object_store import Store
from steps.tracking import trackers as tracking
from steps.training import publication
from steps.training.candidate_writer import (
    optimizer_files,
    optimizer_shard,
    stored_bits,
    weight_digests,
    write_optimizer_shard,
    write_weight_shard,
    write_weights_metadata,
    writer_plan,
    writes,
)
from steps.training.held_state import HeldReference, HeldState, move_experts
from steps.training.optimizer_state import (
    load_optimizer_state,
    optimizer_state_names,
    optimizer_state_tensors,
    read_optimizer_state,
    restore_optimizer_state,
)
from steps.training.optimizer_write import OptimizerWrite
from steps.training.sharding import any_sharded, full_state_dict, shard_experts, shard_non_experts
from steps.training.trainer import PolicyTrainer, TrainSettings, new_adamw, prompt_groups

T = TypeVar("T")
COLLECTIVE_TIMEOUT_SECONDS = 60 * 60


def check_token_ids(samples: list, vocab_size: int, where: str) -> None:
    """Token ids outside the policy's vocabulary mean experience from another model or tokenizer."""
    for s in samples:
        bad = [t for t in (*s.prompt_ids, *s.response_ids) if not 0 <= t < vocab_size]
        if bad:
            raise MoerlError(
                f"{where}: prompt_id {s.prompt_id!r} sample {s.sample_index} holds token id {bad[0]} outside the "
                f"policy's vocabulary of {vocab_size}; the experience comes from another model or tokenizer — "
                "regenerate it with this run's rollout"
            )


# ----------------------------------------------------------------------------------------------------
# Running the same thing on every rank, with one outcome
# ----------------------------------------------------------------------------------------------------


def agreed(mesh: Mesh, fn: Callable[[], T]) -> T:
    """Run fn on this rank; if it fails on any rank, fail on every rank (no rank left waiting in a
    collective). The failing rank raises its own error, the others say which rank failed."""
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except Exception as err:  # re-raised below, after the ranks agreed
        error = err
    if mesh.world_group is not None:
        flag = torch.tensor([float(mesh.rank + 1) if error else 0.0], device=mesh.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed_rank = int(flag.item()) - 1
        if error is None and failed_rank >= 0:
            error = MoerlError(f"trainer rank {failed_rank} failed (its error is above); rank {mesh.rank} stops too")
    if error is not None:
        error.moerl_agreed = True  # type: ignore[attr-defined]  # every rank raises here: trainer_server reads it
        raise error
    return result


# ----------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------


def fetch_checkpoint(run: Store, version: int, mesh: Mesh, local_rank: int) -> Path:
    """Download a published version once per node: local rank 0 fetches it into the node's cache and checks
    every file's size and sha256 against its MANIFEST while the other ranks wait in the same collective;
    they then read the directory it verified (hashing it on every rank would cost 8 x ~120 GB a node)."""
    checkpoint.require_manifest(run, version)
    agreed(mesh, lambda: checkpoint.fetch(run, version) if local_rank == 0 else None)
    return checkpoint.cache_dir_for(run, version)


def previous_expert_rows(run: Store, iteration: int, num_layers: int, num_experts: int) -> list[list[int]]:
    """The per-expert routed row counts update `iteration` recorded ([MoE layer][expert]); ValueError saying
    what is wrong when its metrics are absent or do not hold a table of this model's shape."""
    key = update_metrics_key(iteration)
    if not run.exists(key):
        raise ValueError(f"{key} is absent")
    try:
        data = run.get_json(key)
    except MoerlError as err:
        raise ValueError(str(err)) from err
    if not isinstance(data, dict) or data.get("iteration") != iteration or not isinstance(data.get("update"), dict):
        raise ValueError(f"{key} is not the update metrics of iteration {iteration}")
    rows = data["update"].get("expert_rows")
    if not isinstance(rows, list) or len(rows) != num_layers or any(
        not isinstance(r, list) or len(r) != num_experts or any(type(x) is not int or x < 0 for x in r)
        for r in rows
    ):
        raise ValueError(f"{key}: expert_rows is not a [{num_layers}][{num_experts}] table of row counts")
    return rows


def choose_placement(
    run: Store, iteration: int, mode: str, model_config: FamilyConfig, ep_size: int
) -> tuple[ExpertPlacement, str]:
    """The expert placement of update `iteration` and why (see the module docstring): balanced from the row
    counts of update iteration-1, or contiguous. Never fails on the counts: absent or malformed ones give
    the contiguous placement, with the reason."""
    num_layers, num_experts = len(moe_layer_indices(model_config)), model_config.num_experts
    contiguous = ExpertPlacement.contiguous(num_layers, num_experts, ep_size)
    if mode == "contiguous":
        return contiguous, "contiguous (trainer.expert_placement: contiguous)"
    if ep_size == 1:
        return contiguous, "contiguous (one EP rank holds every expert)"
    if iteration == 1:
        return contiguous, "contiguous (iteration 1: no earlier update counted the experts' rows)"
    try:
        rows = previous_expert_rows(run, iteration - 1, num_layers, num_experts)
    except ValueError as err:
        return contiguous, f"contiguous ({err}; balancing needs the previous update's expert_rows)"
    placement = balanced_placement(rows, ep_size)

    def busiest(p: ExpertPlacement) -> str:
        return "/".join(f"{max(r) / max(1, sum(r)):.0%}" for r in p.rank_rows(rows))

    return placement, (
        f"balanced from the expert rows of {update_metrics_key(iteration - 1)} (busiest EP rank's share per "
        f"MoE layer there: contiguous {busiest(contiguous)}, balanced {busiest(placement)})"
    )


def agreed_placement(
    run: Store, iteration: int, mode: str, model_config: FamilyConfig, mesh: Mesh
) -> tuple[ExpertPlacement, str]:
    """choose_placement on rank 0 (one read), its slots broadcast as a tensor (nothing pickled) so that every
    rank holds the same experts; the reason is rank 0's (it writes the metrics and the log)."""
    chosen = agreed(
        mesh,
        lambda: choose_placement(run, iteration, mode, model_config, mesh.ep_size) if mesh.rank == 0 else None,
    )  # fmt: skip
    if mesh.world_group is None:
        return chosen
    shape = (len(moe_layer_indices(model_config)), model_config.num_experts)
    slots = torch.tensor(chosen[0].slots if chosen else [[0] * shape[1]] * shape[0], dtype=torch.int64)
    slots = slots.to(mesh.device)
    dist.broadcast(slots, src=0)
    if mesh.rank == 0:
        return chosen
    return ExpertPlacement.from_lists(slots.cpu().tolist(), mesh.ep_size), ""


def placement_metrics(placement: ExpertPlacement, reason: str, rows: torch.Tensor) -> dict[str, Any]:
    """What the metrics say about expert placement: the rows each expert got ([MoE layer][expert], all
    ranks, every forward pass of the policy), the placement used, and the rows per EP rank under it."""
    counts = rows.tolist()
    return {
        "expert_rows": counts,
        "expert_placement": {"ep_size": placement.ep_size, "slots": placement.to_lists(), "reason": reason},
        "expert_rank_rows": placement.rank_rows(counts),
    }


# ----------------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------------


def init_distributed() -> tuple[int, int, int, torch.device]:
    """(rank, world size, local rank, device) from torchrun's environment; starts the process group."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # Deterministic kernels where torch has them; warn_only: a kernel without one warns instead of failing.
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        # Long enough for local rank 0 to download and hash a ~120 GB checkpoint while the node's other ranks
        # wait for it in a collective (NCCL's default is 10 minutes).
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS)
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return rank, world, local_rank, device


@dataclass(frozen=True)
class IterationWork:
    """What update `iteration` trains on, read from the store (the same on every rank)."""

    run: Store
    cfg: RunConfig
    iteration: int
    version: int  # the behaviour policy that generated the samples
    samples: list[Sample]
    settings: TrainSettings
    # the candidate's weights are stored and indexed, its optimizer shards are not (a trainer lost after it
    # answered: steps/training/optimizer_write.py): train again, check the weights' bits, write the rest
    replay: bool = False


def pending_iteration(run: Store, iteration: int, force: bool = False, rank: int = 0) -> IterationWork | None:
    """Update `iteration`'s inputs, or None when there is nothing to do (v(I) published, or its candidate
    complete and not `force`). A candidate whose weights were indexed and whose optimizer shards never came
    (WEIGHTS.json and DELTA.json without CANDIDATE.json) is replayed (IterationWork.replay)."""
    if iteration < 1:
        raise MoerlError(f"--iteration {iteration}: iterations start at 1 (v000000 is the SFT checkpoint)")
    cfg = load_run_config(run)
    if checkpoint.read_manifest(run, iteration) is not None:
        _say(rank, f"{version_name(iteration)} is already published; nothing to do")
        return None
    if candidate.read_marker(run, iteration) is not None and not force:
        if rank == 0:  # a retry after the candidate: its delta indexed too, if the crash came between the two
            index_candidate_delta(run, cfg, iteration)
        _say(rank, f"candidate of iteration {iteration} is complete; nothing to do (--force retrains it)")
        return None
    indexed = run.exists(delta_index_key(iteration))  # from the store: the config's deltas may have changed since
    weights = candidate.read_weights_marker(run, iteration) if indexed else None
    if indexed and (force or weights is None):  # --force, or a candidate deleted
        raise MoerlError(
            f"{'--force: ' if force else ''}{version_name(iteration)} was indexed from its candidate "
            f"({run.url(delta_index_key(iteration))}) and rollout servers may have generated with it: an indexed "
            f"version is final. Publish it (python -m steps.publish --run {run.uri} --iteration {iteration}), or "
            f"delete the experience sampled from {version_name(iteration)} and {run.url(delta_prefix(iteration))} "
            "before training it again"
        )
    weight_delta.require_version_files(run, iteration - 1)  # published, or indexed for a trainer that holds it
    version = behaviour_version(iteration, cfg.staleness)
    samples = read_scored_experience(run, iteration, version)
    if indexed:
        _say(
            rank,
            f"{version_name(iteration)} is indexed ({run.url(delta_index_key(iteration))}) but its candidate has no "
            f"optimizer shards ({candidate.MARKER} missing): training iteration {iteration} again from the same "
            f"inputs; its weights must come out as {candidate.WEIGHTS_MARKER} records them",
        )
    settings = TrainSettings.from_run_config(cfg)
    return IterationWork(run, cfg, iteration, version, samples, settings, replay=indexed)


def check_replayed(run: Store, iteration: int, shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0 of a replay: the weight files the ranks wrote locally against the stored candidate's
    WEIGHTS.json (every file, size and sha256); returns that marker. A difference is refused: the version was
    indexed, so its weights are final, and the optimizer state of other weights would not belong to them."""
    marker = candidate.read_weights_marker(run, iteration)
    where = run.url(candidate_prefix(iteration))
    if marker is None:
        raise MoerlError(f"{where}: {candidate.WEIGHTS_MARKER} disappeared while iteration {iteration} was replayed")
    replayed = {name: meta for shard in shards for name, meta in shard["files"].items()}
    for name, meta in sorted(replayed.items()):
        stored = marker["files"].get(name)
        if stored is None or (int(stored["size"]), str(stored["sha256"])) != (int(meta["size"]), str(meta["sha256"])):
            raise MoerlError(
                f"{where}/{name}: training iteration {iteration} again did not reproduce the weights "
                f"{candidate.WEIGHTS_MARKER} records (the trainer's arithmetic is not deterministic here: another "
                f"world size, EP size, device or kernel than the update that wrote it), so the optimizer state it "
                f"lost cannot be rebuilt; {version_name(iteration)} is indexed and final: start a new run from "
                f"{version_name(iteration - 1)} (sft_checkpoint: its published directory)"
            )
    return marker


def index_candidate_delta(run: Store, cfg: RunConfig, iteration: int) -> None:
    """Index v(iteration)'s delta once its candidate's weights are complete (steps/training/publication.py),
    where the run writes deltas: rollout servers may take v(iteration) from then on, before publish."""
    marker = candidate.read_weights_marker(run, iteration)
    if weight_delta.wanted(cfg) and marker is not None and checkpoint.read_manifest(run, iteration) is None:
        summary = publication.index_candidate(run, iteration, marker, lambda line: print(line, flush=True))
        print(f"{weight_delta.describe(summary)}: usable by rollout servers before it is published", flush=True)


def run_update(
    run_uri: str,
    iteration: int,
    ep_size: int | None = None,
    force: bool = False,
    timer: CommTimer | None = None,
) -> dict[str, Any] | None:
    """Train iteration `iteration` and write its candidate; returns the marker (None when nothing to do)."""
    if iteration < 1:
        raise MoerlError(f"--iteration {iteration}: iterations start at 1 (v000000 is the SFT checkpoint)")
    rank, world, local_rank, device = init_distributed()
    try:
        run = Store.open(run_uri)
        work = pending_iteration(run, iteration, force, rank)
        if work is None:
            return None
        # Model config first (cheap) to size the mesh; then the mesh; then the weights of this rank's slice.
        mesh = Mesh(rank=rank, world_size=world, device=device)
        mesh.world_group = dist.group.WORLD if world > 1 else None
        parent_dir = fetch_checkpoint(run, iteration - 1, mesh, local_rank)
        model_config = load_config(parent_dir)
        ep = resolve_ep_size(world, model_config.num_experts, ep_size or work.cfg.trainer.ep_size)
        mesh = build_mesh(rank, world, ep, device)
        marker, _ = train_iteration(work, mesh, local_rank, model_config, parent_dir=parent_dir, timer=timer)
        return marker
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train_iteration(
    work: IterationWork,
    mesh: Mesh,
    local_rank: int,
    model_config: FamilyConfig,
    held: HeldState | None = None,
    parent_dir: Path | None = None,
    timer: CommTimer | None = None,
    dispatches: HeldDispatch | None = None,
    reference: HeldReference | None = None,
    before_write: Callable[[], None] | None = None,
    write_optimizer_later: Callable[[OptimizerWrite], None] | None = None,
) -> tuple[dict[str, Any] | None, HeldState]:
    """Train `work` on `mesh` from v(I-1) and write candidate I; returns the marker (rank 0; None on the
    others) and what this rank holds of the version trained (HeldState). v(I-1) comes from `held`, when
    the caller found it to be that version as published (HeldState.matches; every rank must agree), else
    from the store (parent_dir: the version's local copy when the caller already fetched it). `dispatches`:
    the expert dispatcher a trainer that stays up keeps across updates (else one is made for this one);
    `reference`: the KL reference it keeps (loaded by its first update with kl_coef > 0). `before_write`: run
    (agreed) once trained, before anything is written (a trainer that stays up joins the previous update's
    optimizer write there); `write_optimizer_later`: given, the optimizer shards are not written here but handed
    to it as a started OptimizerWrite once WEIGHTS.json is written and the delta indexed, and the marker
    returned is WEIGHTS.json's (steps/training/optimizer_write.py). A replay (work.replay) writes no weights:
    it checks them against the stored ones and writes the optimizer shards and CANDIDATE.json."""
    run, cfg, iteration = work.run, work.cfg, work.iteration
    parent, rank, world, device = iteration - 1, mesh.rank, mesh.world_size, mesh.device
    samples, settings = work.samples, work.settings
    check_token_ids(samples, model_config.vocab_size, run.url(scored_key(iteration)))
    placement, placement_reason = agreed_placement(run, iteration, cfg.trainer.expert_placement, model_config, mesh)
    _say(rank, f"expert placement: {placement_reason}")
    # Trained in fp32 whatever the run's checkpoint dtype (the parent's: every version keeps v000000's);
    # from v000001 on, the fp32 masters in the parent's optimizer state replace the rounded weights.
    if held is not None:
        if held.version != parent:
            raise MoerlError(f"trainer rank {rank} holds {version_name(held.version)}, not {version_name(parent)}")
        moved = move_experts(held, placement, mesh, model_config)  # now this rank's share under this placement
        _say(rank, f"{version_name(parent)} from memory; {moved} expert(s) changed EP rank")
        dtype = held.dtype
        model = model_from_state(model_config, held.weights, torch.float32, device, placement, mesh.ep_rank)
        parent_dir = None
    else:
        parent_dir = parent_dir or fetch_checkpoint(run, parent, mesh, local_rank)
        dtype = checkpoint_dtype(parent_dir)
        model = load_pretrained(parent_dir, torch.float32, device, placement, mesh.ep_rank)
    model.count_routed_rows()
    if cfg.trainer.router == "freeze":  # no gradient, no AdamW state: the routers keep v000000's values
        for p in model.router_parameters():
            p.requires_grad_(False)
    model.router_aux_loss_coef = cfg.trainer.router_aux_loss_coef
    model.activation_checkpointing = cfg.trainer.activation_checkpointing
    set_grouped_gemm(cfg.trainer.grouped_gemm)
    ref_model, ref_state = None, None
    if settings.loss.kl_coef > 0:
        ref_state = reference.take(mesh) if reference is not None else None
        if ref_state is not None:  # held: its experts follow this update's placement
            move_experts(ref_state, placement, mesh, model_config)
            weights = ref_state.weights
            ref_model = model_from_state(model_config, weights, torch.float32, device, placement, mesh.ep_rank)
        else:
            ref_dir = parent_dir if parent == 0 and parent_dir is not None else None
            ref_dir = ref_dir or fetch_checkpoint(run, 0, mesh, local_rank)
            ref_model = load_pretrained(ref_dir, torch.float32, device, placement, mesh.ep_rank)
        ref_model.requires_grad_(False)
    cfg_model = model.config
    rows = settings.micro_batch_size
    if settings.shared_prompts:  # micro-batches of whole groups hold up to a group less one row more
        rows += max(len(group) for group in prompt_groups(samples)) - 1
    max_tokens = rows * max(s.num_tokens for s in samples)
    dispatch = (dispatches.get if dispatches is not None else make_dispatch)(
        cfg.trainer.ep_backend, mesh, model_config.num_experts, cfg_model.hidden_size, cfg_model.num_experts_per_tok,
        max_tokens, timer,
    )  # fmt: skip
    model.set_dispatch(dispatch)
    if ref_model is not None:
        ref_model.set_dispatch(dispatch)
    # before the optimizer (its state takes the parameters' layout); the experts first (their own FSDP2 units)
    if cfg.trainer.shard_experts and shard_experts(model, mesh):
        _say(rank, f"shard_experts: each EP rank's experts sharded over its {mesh.dp_size} dp replicas")
    if cfg.trainer.fsdp and shard_non_experts(model, mesh):
        _say(rank, f"fsdp: the non-expert parameters, their gradients and AdamW state sharded over {world} ranks")

    torch.manual_seed(cfg.seed * 1_000_003 + iteration)
    optimizer = new_adamw(model, settings)
    workdir = Path(tempfile.mkdtemp(prefix=f"moerl-update-{rank}-"))
    try:
        if held is not None:  # the same restore as from the store's file, without masters: the weights are them
            optimizer_state = held.optimizer
            agreed(mesh, lambda: load_optimizer_state(model, optimizer, optimizer_state))
        elif parent > 0:
            names = optimizer_state_names(model)
            state = agreed(mesh, lambda: read_optimizer_state(run, parent, names, workdir))
            agreed(mesh, lambda: restore_optimizer_state(run, parent, model, optimizer, state, dtype))
        held = None  # its tensors are the model's and the optimizer's now
        replay = work.replay
        if not replay:  # a crashed attempt may have left part of a candidate: removed before anything is written
            agreed(mesh, lambda: run.delete_prefix(candidate_prefix(iteration)) if rank == 0 else None)

        # Who writes which file of the candidate: every EP rank's files spread over its dp replicas and nodes.
        writers = writer_plan(model, mesh, dtype)
        # v(I-1)'s bits, the parent of the delta of this rank's weight file if it writes that file (its weights
        # now are those v(I-1) was stored from)
        deltas = weight_delta.wanted(cfg) and not replay
        wants_delta = deltas and writes(mesh, writers, candidate.WEIGHTS)
        delta_parent = None
        if wants_delta or (deltas and any_sharded(model)):  # sharded: every rank gathers
            delta_parent = stored_bits(model, mesh, dtype, keep=wants_delta)
        trainer = PolicyTrainer(model, mesh, settings, optimizer, ref_model, pad_id=cfg_model.pad_token_id or 0)
        # progress: the optimizer steps, then the candidate's write as one more unit
        metrics = trainer.train(samples, iteration, on_step=lambda done, steps: progress.report(done, steps + 1))
        info = {"policy_version": work.version, "world_size": world, "ep_size": mesh.ep_size,
                "dp_size": mesh.dp_size, "ep_backend": cfg.trainer.ep_backend}  # fmt: skip
        metrics.update(info)
        metrics.update(placement_metrics(placement, placement_reason, all_reduce_sum(model.routed_rows(), mesh)))
        if timer is not None and timer.enabled:
            metrics["dispatch_seconds"] = timer.seconds
        if before_write is not None:
            agreed(mesh, before_write)

        later = write_optimizer_later is not None and not replay
        shard = agreed(
            mesh,
            lambda: write_weight_shard(run, iteration, mesh, model, workdir, dtype, delta_parent, writers, not replay),
        )  # every rank's part is written before rank 0 writes WEIGHTS.json (agreed: all ranks wait for all)
        opt_shard = agreed(mesh, lambda: optimizer_shard(model, optimizer, mesh, writers, dtype, copy=later))
        shard["optimizer"] = dict.fromkeys(opt_shard[1], opt_shard[0]) if opt_shard is not None else {}
        shards = _gathered(mesh, shard)  # names and digests only, never tensors
        if parent_dir is not None:
            local_parent = parent_dir
            parent_file: Callable[[str], bytes] = lambda name: (local_parent / name).read_bytes()  # noqa: E731
        else:  # the trainer holds v(I-1), which may be indexed and not published yet
            parent_file = lambda name: weight_delta.read_version_file(run, parent, name)  # noqa: E731
        if replay:
            weights_marker = agreed(mesh, lambda: check_replayed(run, iteration, shards) if rank == 0 else None)
        else:
            weights_marker = agreed(
                mesh,
                lambda: write_weights_metadata(run, iteration, parent_file, model, shards, info, metrics, dtype)
                if rank == 0 else None,
            )  # fmt: skip
        if later:
            agreed(mesh, lambda: index_candidate_delta(run, cfg, iteration) if rank == 0 else None)
            expected = optimizer_files(shards) if rank == 0 else None
            assert write_optimizer_later is not None
            write_optimizer_later(OptimizerWrite(run, iteration, opt_shard, rank, expected, weights_marker).start())
            marker = weights_marker
        else:
            written = _gathered(mesh, agreed(mesh, lambda: write_optimizer_shard(run, iteration, opt_shard, workdir)))
            files = {name: meta for part in written for name, meta in part.items()}
            marker = agreed(
                mesh, lambda: candidate.write_marker(run, iteration, weights_marker, files) if rank == 0 else None
            )
            agreed(mesh, lambda: index_candidate_delta(run, cfg, iteration) if rank == 0 else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    progress.report(metrics["steps"] + 1, metrics["steps"] + 1)
    _say(
        rank,
        f"iteration {iteration}: loss {metrics['loss']:.6f}, clip fraction {metrics['clip_fraction']:.4f}, "
        f"grad norm {metrics['grad_norm']:.4f}, {metrics['tokens_per_s']:.0f} tokens/s on {world} rank(s) "
        f"(ep {mesh.ep_size}); candidate {run.url(candidate_prefix(iteration))}",
    )
    if rank == 0 and not work.replay:  # the metrics are in the store (the candidate's metadata): the trackers' copy
        tracking.log_iteration(run, cfg, "update", iteration, metrics, lambda line: print(line, flush=True))
    if reference is not None and ref_model is not None:
        reference.give_back(ref_state, ref_model, placement)
    trained = HeldState(
        version=iteration,
        dtype=dtype,
        placement=placement,
        weights=full_state_dict(model),  # whole tensors, the sharded ones gathered (every rank)
        optimizer=optimizer_state_tensors(model, optimizer),
        weight_digests=weight_digests(shards),
    )
    return marker, trained


def _gathered(mesh: Mesh, part: T) -> list[T]:
    """Every rank's `part` (small JSON-like values: names and digests), in rank order."""
    if mesh.world_size == 1:
        return [part]
    parts: list[Any] = [None] * mesh.world_size
    dist.all_gather_object(parts, part)
    return parts


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)
