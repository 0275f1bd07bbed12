"""What a trainer that stays up holds between two updates, per rank: exactly what a reload of the version it
trained would give that rank, so that training on from memory and training after a restart are the same
arithmetic on the same bits.

A reload of v(I) (steps/training/update.py) gives each rank: its parameters in fp32 (the published weights
upcast, replaced by the fp32 masters of the optimizer state when the published dtype is narrower), and
AdamW's state of those parameters (exp_avg, exp_avg_sq, step), for the experts that update I+1's placement
gives it. HeldState keeps the same tensors, by their global names, as the trainer left them after writing
candidate I: the fp32 parameters (they are the masters) and AdamW's state, for the experts of update I's
placement. When update I+1 places the experts otherwise, `move_experts` sends each moved expert's tensors
from the rank that held it to the rank that will (point to point, within each data-parallel row), so every
rank then holds what a reload would give it. The model and optimizer are rebuilt from these tensors with the
code that a reload uses (hf_checkpoint.model_from_state, optimizer_state.load_optimizer_state).

A held state is used only for the version it was trained into, and only once that version is published
with the very weights the trainer wrote (`matches`: the published weight files' digests are those of the
candidate's weight shards, which publish renames): a version trained elsewhere, or republished, is reloaded.
HeldReference keeps the KL reference (v000000) the same way, without AdamW state, across every update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steps.expert_parallel.mesh import Mesh, all_reduce_sum
from steps.models.placement import ExpertPlacement
from steps.models.registry import family_of
from steps.training.optimizer_state import ADAMW_FIELDS


@dataclass
class HeldState:
    version: int  # the version these tensors are (its candidate's iteration)
    dtype: torch.dtype  # the run's checkpoint dtype (every version's)
    placement: ExpertPlacement  # the experts this rank's tensors cover
    weights: dict[str, torch.Tensor]  # this rank's parameters, fp32, on the CPU
    optimizer: dict[str, torch.Tensor]  # `<param name>.<AdamW field>` of those parameters
    weight_digests: list[tuple[int, str]]  # (size, sha256) of every weight shard of the candidate written

    def matches(self, version: int, files: dict[str, dict[str, int | str]]) -> bool:
        """Whether this is `version` as the run has it (`files`: its MANIFEST.json's, or its DELTA.json's before
        it is published): the same weight files, byte for byte."""
        published = sorted(
            (int(meta["size"]), str(meta["sha256"])) for name, meta in files.items() if name.endswith(".safetensors")
        )
        return self.version == version and published == sorted(self.weight_digests)


class HeldReference:
    """The KL reference (v000000) that a trainer that stays up keeps from one update to the next: this rank's
    share of its weights, fp32 on the CPU, under the placement of the update that last used it. The next
    update moves its experts to its own placement (held_state.move_experts, with no AdamW state) instead
    of reading v000000 again: the same tensors a load under that placement gives. An update takes it out
    and gives it back only once its candidate is written, so a failed one leaves none (the next reloads),
    and the ranks use it only if every rank holds one."""

    def __init__(self) -> None:
        self.state: HeldState | None = None
        self.loads = 0

    def take(self, mesh: Mesh) -> HeldState | None:
        state, self.state = self.state, None
        missing = torch.tensor([0 if state is not None else 1], device=mesh.device)
        return state if int(all_reduce_sum(missing, mesh).item()) == 0 else None

    def give_back(self, state: HeldState | None, model: nn.Module, placement: ExpertPlacement) -> None:
        if state is None:  # loaded by this update
            weights = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
            state = HeldState(0, torch.float32, placement, weights, optimizer={}, weight_digests=[])
            self.loads += 1
        self.state = state


def owner(placement: ExpertPlacement, layer: int, expert: int) -> int:
    """The EP rank that holds global expert `expert` of MoE layer `layer`."""
    return placement.slots[layer].index(expert) // placement.per_rank


def expert_params(cfg: Any, layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of one expert's parameters, as its family's state-dict adapter names them; `layer` counts
    the MoE layers."""
    return family_of(cfg).state_dict_adapter.expert_params(cfg, layer, expert)


def move_experts(held: HeldState, placement: ExpertPlacement, mesh: Mesh, cfg: Any) -> int:
    """Bring `held` from its placement to `placement`: each expert that changes EP rank is sent, with its
    AdamW state, from its old rank to its new one in every data-parallel row. Every rank walks the moves in
    the same order, so each blocking send meets its receive (the earliest unfinished move always has both
    of its ranks at it). Tensors travel as fp32 on the mesh's device (NCCL needs them there). Returns how
    many (MoE layer, expert) pairs changed EP rank."""
    old, moved = held.placement, 0
    for layer in range(placement.num_layers):
        for expert in range(placement.num_experts):
            src_ep, dst_ep = owner(old, layer, expert), owner(placement, layer, expert)
            if src_ep == dst_ep:
                continue
            moved += 1
            src, dst = mesh.dp_rank * mesh.ep_size + src_ep, mesh.dp_rank * mesh.ep_size + dst_ep
            if mesh.rank == src:
                _send_expert(held, expert_params(cfg, layer, expert), dst, mesh.device)
            elif mesh.rank == dst:
                _receive_expert(held, expert_params(cfg, layer, expert), src, mesh.device)
    held.placement = placement
    return moved


def _send_expert(held: HeldState, params: list[tuple[str, tuple[int, ...]]], dst: int, device: torch.device) -> None:
    # Which AdamW fields each parameter has (a parameter that never had a gradient has none): a mask first.
    present = [[f"{name}.{f}" in held.optimizer for f in ADAMW_FIELDS] for name, _ in params]
    dist.send(torch.tensor(present, dtype=torch.int64, device=device), dst)
    for (name, _), fields in zip(params, present, strict=True):
        tensors = [held.weights.pop(name)]
        tensors += [held.optimizer.pop(f"{name}.{f}") for f, has in zip(ADAMW_FIELDS, fields, strict=True) if has]
        for t in tensors:
            assert t.dtype == torch.float32, f"{name}: held tensors are fp32, not {t.dtype}"
            dist.send(t.to(device).contiguous(), dst)


def _receive_expert(held: HeldState, params: list[tuple[str, tuple[int, ...]]], src: int, device: torch.device) -> None:
    present = torch.zeros((len(params), len(ADAMW_FIELDS)), dtype=torch.int64, device=device)
    dist.recv(present, src)
    for (name, shape), fields in zip(params, present.cpu().tolist(), strict=True):
        held.weights[name] = _receive(shape, src, device)
        for f, has in zip(ADAMW_FIELDS, fields, strict=True):
            if has:  # AdamW's step count is a 0-dim tensor, the moments have the parameter's shape
                held.optimizer[f"{name}.{f}"] = _receive(() if f == "step" else shape, src, device)


def _receive(shape: tuple[int, ...], src: int, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32, device=device)
    dist.recv(t, src)
    return t.cpu()
