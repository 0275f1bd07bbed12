"""Optimizer state as files: AdamW's state (and the fp32 masters) of the trainer's parameters as flat tensors,
and the run store's copy of it that the next update resumes from.

    <run>/optimizer/v000003/optimizer-rank0000r-of-0000n.safetensors   `<param name>.<field>` tensors
    <run>/optimizer/v000003/optimizer.index.json                      written last: tensor name -> file

Tensors are named like the model's parameters (the checkpoint's names, but where a family's state-dict adapter
renames modules), so each expert's state lives with the EP rank that holds the expert and is read back by name,
whichever rank's file of the previous iteration holds it. Update writes the shards into
its candidate (steps/run/candidate.py); publish stores them here when it publishes the version.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from steps.errors import MoerlError
from steps.models.family import dtype_name
from steps.run.keys import OPTIMIZER_INDEX, optimizer_prefix, version_name
from steps.store.object_store import Store
from steps.training.optim import AnyOptimizer
from steps.training.sharding import full_tensor, like_param

ADAMW_FIELDS = ("exp_avg", "exp_avg_sq", "step")
# The fp32 weights themselves, when the published ones are narrower (bf16, fp16): what the next update
# resumes from, so that rounding to the published dtype never accumulates into the training (see
# optimizer_state_tensors).
MASTER_FIELD = "master"
OPTIMIZER_FIELDS = (*ADAMW_FIELDS, MASTER_FIELD)  # every field an optimizer state file may hold


def optimizer_state_names(model: nn.Module) -> list[str]:
    """The names of every optimizer state tensor this rank's parameters may have (`<param name>.<field>`)."""
    return [f"{name}.{f}" for name, _ in model.named_parameters() for f in OPTIMIZER_FIELDS]


def optimizer_state_tensors(
    model: nn.Module, optimizer: AnyOptimizer, published_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """AdamW state of this rank's parameters as flat tensors: `<param name>.<field>` (named like the
    weights, so that each expert's state lives with the rank that holds the expert), and when the weights
    are published in a narrower dtype than they are trained in, every parameter's `<param name>.master`:
    its exact trained value (fp32). Parameters sharded by trainer.fsdp give their whole tensors: a collective,
    which every rank calls (steps/training/sharding.py)."""
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        for f in ADAMW_FIELDS:
            if f in state:
                t = state[f] if torch.is_tensor(state[f]) else torch.tensor(float(state[f]))
                out[f"{name}.{f}"] = full_tensor(t).detach().to("cpu").contiguous()
        if published_dtype != p.dtype:
            out[f"{name}.{MASTER_FIELD}"] = full_tensor(p).detach().to("cpu").contiguous()
    return out


def load_optimizer_state(
    model: nn.Module, optimizer: AnyOptimizer, tensors: dict[str, torch.Tensor], needs_master: bool = False
) -> int:
    """Restore AdamW state written by optimizer_state_tensors (for this rank's parameters), and each
    parameter's master weights where the state holds them (they replace the published, rounded weights
    the model was loaded from); a parameter sharded by trainer.fsdp takes its shard of each (no communication).
    needs_master: the published weights are narrower than the parameters, so
    every parameter must have its master. Returns how many parameters got AdamW state."""
    restored = 0
    for name, p in model.named_parameters():
        master = tensors.get(f"{name}.{MASTER_FIELD}")
        if master is not None:
            if master.shape != p.shape or master.dtype != p.dtype:
                raise MoerlError(
                    f"the master weights of {name} are {dtype_name(master.dtype)} "
                    f"{list(master.shape)}, the parameter {dtype_name(p.dtype)} {list(p.shape)}; the optimizer "
                    "state belongs to another model"
                )
            with torch.no_grad():
                p.copy_(like_param(p, master))
        elif needs_master:
            raise MoerlError(
                f"no fp32 master weights for {name} ({name}.{MASTER_FIELD}), whose published weights are narrower "
                "than fp32: an update resumes from the masters, not from the rounded weights — start a new run "
                "whose sft_checkpoint is the published version (its AdamW state starts over)"
            )
        keys = [f"{name}.{f}" for f in ADAMW_FIELDS]
        if not all(k in tensors for k in keys):
            continue
        exp_avg, exp_avg_sq, step = (tensors[k] for k in keys)
        if exp_avg.shape != p.shape or exp_avg_sq.shape != p.shape:
            raise MoerlError(
                f"optimizer state of {name} has shape {list(exp_avg.shape)}, the parameter {list(p.shape)}; "
                "the optimizer state belongs to another model"
            )
        optimizer.state[p] = {
            "step": step.to(torch.float32).reshape(()).clone(),
            "exp_avg": like_param(p, exp_avg).clone(),
            "exp_avg_sq": like_param(p, exp_avg_sq).clone(),
        }
        restored += 1
    return restored


# ----------------------------------------------------------------------------------------------------
# On the run store
# ----------------------------------------------------------------------------------------------------


def store_optimizer_state(run: Store, version: int, local_dir: Path, weight_map: dict[str, str]) -> None:
    """<run>/optimizer/v(version)/: the shard files of local_dir that weight_map (tensor name -> file) names,
    then optimizer.index.json (its presence means complete)."""
    prefix = optimizer_prefix(version)
    for name in sorted(set(weight_map.values())):
        run.put_file(f"{prefix}/{name}", local_dir / name)
    run.put_json(f"{prefix}/{OPTIMIZER_INDEX}", {"weight_map": weight_map})


def read_optimizer_state(run: Store, version: int, names: list[str], workdir: Path) -> dict[str, torch.Tensor]:
    """The AdamW state tensors named `names` from <run>/optimizer/v(version)/ (only the files holding them)."""
    prefix = optimizer_prefix(version)
    index_key = f"{prefix}/{OPTIMIZER_INDEX}"
    if not run.exists(index_key):
        raise MoerlError(
            f"{run.url(index_key)}: missing; checkpoint {version_name(version)} was published "
            "without its optimizer state — republish it (python -m steps.publish) or start a new run"
        )
    weight_map: dict[str, str] = run.get_json(index_key)["weight_map"]
    wanted: dict[str, list[str]] = {}
    for name in names:
        if name in weight_map:
            wanted.setdefault(weight_map[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file_name, file_names in sorted(wanted.items()):
        local = workdir / file_name
        run.get_file(f"{prefix}/{file_name}", local)
        with safe_open(str(local), framework="pt") as f:
            missing = sorted(set(file_names) - set(f.keys()))
            if missing:
                raise MoerlError(
                    f"{run.url(f'{prefix}/{file_name}')}: lacks {missing[0]} ({len(missing)} tensors in all) that "
                    f"{OPTIMIZER_INDEX} puts there; the optimizer state is corrupted — start a new run from "
                    f"{version_name(version)}"
                )
            for name in file_names:
                tensors[name] = f.get_tensor(name)
        local.unlink()
    return tensors


def restore_optimizer_state(
    run: Store,
    version: int,
    model: nn.Module,
    optimizer: AnyOptimizer,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
) -> None:
    """AdamW state and fp32 masters of v(version) into this rank's model and optimizer; the masters are
    required when that version's weights are published narrower than fp32 (`dtype`)."""
    try:
        load_optimizer_state(model, optimizer, state, needs_master=dtype != torch.float32)
    except MoerlError as err:
        raise MoerlError(f"{run.url(optimizer_prefix(version))}: {err}") from None
